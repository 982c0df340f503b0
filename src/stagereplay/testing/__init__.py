"""What the tests and the bench scripts share: random models of a named shape, written as the files the pipeline
reads. Nothing in the pipeline imports this package; gguf-py (the optional extra ``gguf``) is imported only when a
GGUF file is written."""
