"""Bad datasets and configs (docs/BAD_INPUTS.md): each refused before any work, naming the file and line, the row,
the item or the key and saying what to do; valid values accepted; a user's config complete by itself.

Checks that live in the package are tested on its functions (the loaders, the preflight, the config helpers);
what only the workflow does (which config files it reads, how it types ``--config``) in a few dry runs.
"""

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from stagereplay.config import check_boundary, check_boundary_set, schema_file, typed_command_line_values
from stagereplay.data.datasets import DatasetError, load_source
from stagereplay.data.prompts import Prompter, UnknownCharactersError, UnreachableBoundaryError, check_template
from stagereplay.data.toy import build_tokenizer
from stagereplay.stages.preflight import check_run
from workflow_runner import snakemake, snakemake_command, tiny_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO / "workflow/schemas/config.schema.yaml"
SCHEMA = yaml.safe_load(SCHEMA_PATH.read_text())


def valid_config(**overrides):
    """The default experiment's config with ``overrides``, as the workflow hands it to the preflight."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(overrides)
    validate(cfg, schema_file(), set_default=True)
    cfg["model"] = str(REPO / cfg["model"])
    return cfg


def without_configfile(command: list[str]) -> list[str]:
    """A workflow command line as ``snakemake --cores all`` has it: no --configfile."""
    at = command.index("--configfile")
    return command[:at] + command[at + 2:]


def run(command: list[str]):
    import subprocess

    return subprocess.run(command, capture_output=True, text=True)


# --- 1. a user's --configfile is complete by itself, with the schema's defaults -------------------------------

def test_a_users_configfile_takes_the_schema_defaults_not_the_toys(tmp_path):
    """The toy's config.yaml sits in the working directory (the repository root) as it always does; the user's
    file leaves the budgets out, so they are the schema's 4096 + 512, which the toy's context of 256 cannot hold:
    the preflight says so. Before, the toy's 32 + 48 were taken silently and the run went ahead."""
    tiny_config(tmp_path)
    user = tmp_path / "mine.yaml"
    user.write_text(yaml.safe_dump({"run": "mine", "n_items": 2, "device": "cpu", "precisions": ["bf16"],
                                    "dataset": {"source": "synthetic", "size": 20, "seed": 0}}))
    proc = snakemake(tmp_path, "--cores", "1", "--until", "select_items", check=False, configfile=user)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "max_stage_tokens 4096 + max_new_tokens 512 exceeds the model's context of 256" in out, out[-3000:]
    assert not (tmp_path / "results").exists()


def test_without_a_configfile_the_embedded_default_is_read_and_command_line_values_are_typed(tmp_path):
    """``snakemake`` with no --configfile reads config.yaml (its run name is planned). A nested --config value
    reaches the schema typed: ``bridge={n_rows: 2, seed: 0}`` was refused with ``'2' is not of type 'integer'``.
    And a token id given on the command line replaces config.yaml's marker instead of clashing with it."""
    tiny_config(tmp_path, run="from-config-yaml")
    command = without_configfile(snakemake_command(tmp_path, "--dry-run", "--config", "bridge={n_rows: 2, seed: 0}",
                                                   "boundary={token_id: 7}"))
    proc = run(command)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "results/from-config-yaml/primary/ledger.parquet" in out


def test_the_documented_defaults_are_the_schemas():
    """Every scalar default in docs/CONFIGURATION.md's tables is the schema's (the part before any
    "; `config.yaml`: ..." note)."""
    doc = (REPO / "docs/CONFIGURATION.md").read_text()
    documented = dict(re.findall(r"^\| `([a-z_.]+)` \| [^|]+ \| ([^|]+) \|", doc, re.M))

    def render(value):
        return value if isinstance(value, str) else json.dumps(value)  # null, true, 4096

    checked = 0
    for key, cell in documented.items():
        node = SCHEMA
        for part in key.split("."):
            node = node.get("properties", {}).get(part, {})
        if "default" not in node or isinstance(node["default"], (list, dict)):
            continue
        shown = cell.split(";")[0].replace("`", "").strip()
        assert shown.split(" ")[0] == render(node["default"]), f"{key}: the docs say {shown!r}, the schema " \
                                                               f"{node['default']!r}"
        checked += 1
    assert checked >= 40


# --- 2. dataset mistakes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,line", [
    ("question,answer\n1+1,2\n7,8,9\n", 3),  # pandas stopped with a bare ParserError
    ("question,answer\n7,8,9\n", 2),  # pandas made 7 an index: question '8', gold '9'
])
def test_a_csv_line_with_more_fields_than_the_header_is_refused(tmp_path, text, line):
    path = tmp_path / "d.csv"
    path.write_text(text)
    with pytest.raises(DatasetError, match=rf"d.csv: line {line} has 3 fields but the header has 2 "
                                           r"\(question,answer\).*quote a field that holds a comma"):
        load_source({"source": "csv", "path": str(path)})


def test_a_quoted_comma_and_an_empty_cell_read_as_they_are(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('question,answer\n"1,000+1",1001\n2+2,\n')
    with pytest.raises(DatasetError, match="row 3 has no gold answer"):  # the empty cell is empty, not 'nan'
        load_source({"source": "csv", "path": str(path)})
    path.write_text('question,answer\n"1,000+1",1001\n,4\n')
    with pytest.raises(DatasetError, match="row 3 has no question"):
        load_source({"source": "csv", "path": str(path)})


@pytest.mark.parametrize("source,content,match", [
    ("csv", "question,answer\n1+1,2\nNaN,8\n", r"row 3 has the question 'NaN' \(field 'question'\), which is how a "
                                               "missing value is written, not a question; fix or remove it"),
    ("jsonl", [{"question": "nan", "answer": "8"}], "line 1 has the question 'nan'"),
    ("jsonl", [{"question": "1+1", "answer": "NaN"}], "line 1 has the gold answer 'NaN'"),
    ("jsonl", '{"question": "1+1", "answer": NaN}\n', "line 1 has the gold answer 'nan'"),  # JSON's bare NaN
    ("parquet", {"question": ["1+1"], "answer": [float("nan")]}, "row 2 has the gold answer 'nan'"),  # the header is row 1
])
def test_a_missing_value_marker_is_not_text(tmp_path, source, content, match):
    path = tmp_path / f"d.{source}"
    if source == "parquet":
        pd.DataFrame(content).to_parquet(path)
    elif isinstance(content, list):
        path.write_text("".join(json.dumps(r) + "\n" for r in content))
    else:
        path.write_text(content)
    # boxed: no number is needed, so a 'NaN' gold would have passed as text
    with pytest.raises(DatasetError, match=match):
        load_source({"source": source, "path": str(path)}, numeric=False)


def test_item_ids_keep_their_written_form_and_a_missing_one_is_refused(tmp_path):
    """A Parquet integer id column with a missing value: pandas reads it as float64 ("1.0", "nan")."""
    path = tmp_path / "d.parquet"
    fields = {"id": "id"}
    pd.DataFrame({"id": pd.array([1, 2, 3], dtype="Int64"), "question": ["1+1", "2+2", "3+3"],
                  "answer": ["2", "4", "6"]}).to_parquet(path)
    assert [r["item_id"] for r in load_source({"source": "parquet", "path": str(path), "fields": fields})] == [
        "1", "2", "3"]
    pd.DataFrame({"id": pd.array([1, None, 3], dtype="Int64"), "question": ["1+1", "2+2", "3+3"],
                  "answer": ["2", "4", "6"]}).to_parquet(path)
    with pytest.raises(DatasetError, match=re.escape(
            f"{path}: row 3 has no item id (field 'id'); give it one, or leave dataset.fields.id unset to number "
            "every row (row-000001, ...)")):
        load_source({"source": "parquet", "path": str(path), "fields": fields})
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"id": 7, "question": "1+1", "answer": "2"}) + "\n"
                     + json.dumps({"id": None, "question": "2+2", "answer": "4"}) + "\n")
    with pytest.raises(DatasetError, match="line 2 has no item id"):
        load_source({"source": "jsonl", "path": str(jsonl), "fields": fields})


def test_characters_outside_the_toy_vocabulary_are_refused_naming_item_and_characters(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "12+3", "answer": "15"}) + "\n"
                    + json.dumps({"question": "Natalia sold clips to 48 friends", "answer": "48"}) + "\n")
    cfg = valid_config(dataset={"source": "jsonl", "path": str(path)}, n_items=2)
    with pytest.raises(UnknownCharactersError, match=(
            r"item 'row-000002': the question 'Natalia sold clips to 48 friends' has characters the tokenizer of "
            r".*primary does not know \(' ', 'N', 'a', 'c', .*'t'\), which the model would never see \(dropped, or "
            r"read as the unknown token\); it knows only the characters '\+-0123456789:;=AQ'.*Fix or remove the item")):
        check_run(cfg)
    path.write_text(json.dumps({"question": "12+3", "answer": "15"}) + "\n")
    assert check_run(valid_config(dataset={"source": "jsonl", "path": str(path)}, n_items=1))["n_items"] == 1


@pytest.mark.parametrize("prompt,match", [
    ({"instruction": "Solve this:"}, r"the prompt text 'Solve this:\\n\\n[0-9+-]+' \(prompt.instruction: 'Solve this:', "
     r"the tokenizer's chat template\) has characters the tokenizer of .*primary does not know \('\\n', ' ', 'S', "
     r"'e', 'h', 'i', 'l', 'o', 's', 't', 'v'\).*Change the prompt settings to text the tokenizer covers \(an "
     r"instruction is joined to the question by a blank line, '\\n\\n'\)"),
    ({"template": "Question: {question} Answer:"}, r"the prompt text 'Question: [0-9+-]+ Answer:' \(prompt.template: "
     r"'Question: \{question\} Answer:'\) has characters .*\(' ', 'e', 'i', 'n', 'o', 'r', 's', 't', 'u', 'w'\)"),
    ({"system": "Be brief"}, r"the prompt text 'Be brief' \(prompt.system: 'Be brief'"),
])
def test_prompt_text_the_tokenizer_cannot_encode_is_refused(prompt, match):
    """The question alone was checked: prompt.instruction reached the toy as Q::12+7=<think>."""
    with pytest.raises(UnknownCharactersError, match=match):
        check_run(valid_config(prompt=prompt, n_items=2))
    assert check_run(valid_config(prompt={"template": "Q:{question}="}, n_items=2))["n_items"] == 2


def test_a_boundary_marker_the_tokenizer_cannot_produce_is_refused_by_the_preflight():
    """Before: generation ran, no item reached the boundary, and three later stages failed with a traceback."""
    with pytest.raises(UnreachableBoundaryError, match=re.escape(
            "boundary.marker 'END' cannot be produced by the tokenizer of ") + r".*primary: " + re.escape(
            "it has characters no token of the vocabulary writes ('D', 'E', 'N'), so no generated text could contain it "
            "and no item would reach the stage boundary; it knows only the characters '+-0123456789:;=AQ'")):
        check_run(valid_config(boundary={"marker": "END"}, n_items=2))
    for marker in (";", "=;", "</think>"):  # a special token of the toy's is a marker it can write
        check_run(valid_config(boundary={"marker": marker}, n_items=2))


# --- 3. config mistakes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("template,match", [
    ("Solve this.", r"prompt.template 'Solve this.' has no \{question\}, so every item would get the same prompt"),
    ("Q:{problem}=", r"has the placeholder \{problem\}, but the only one filled in is \{question\}: rename it"),
    ("Q:{question}={}", r"has the placeholder \{\}"),
    ("Q:{question}={", r"cannot be filled in .*write \{\{ and \}\} for a literal brace"),
])
def test_a_template_without_question_or_with_another_placeholder_is_refused(template, match):
    with pytest.raises(ValueError, match=match):
        check_template(template)
    with pytest.raises(ValueError, match=match):  # the preflight (and every stage) builds its prompts with it
        check_run(valid_config(prompt={"template": template}, n_items=1))
    check_template("Q:{question}= {{literal}}")
    assert Prompter(build_tokenizer(), template="Q:{question}=")("1+2") == build_tokenizer()("Q:1+2=")["input_ids"]


def test_marker_and_token_id_both_given_are_refused():
    with pytest.raises(ValueError, match=r"boundary.marker ';' and boundary.token_id 7 are both set.*remove one"):
        check_boundary({"marker": ";", "token_id": 7})
    for ok in ({"token_id": 7}, {"marker": None, "token_id": 7}, {"marker": ";"}, None):
        check_boundary(ok)
    # neither: the rerun of reconstruct_prefixes deleted its parts, then died with a traceback
    with pytest.raises(ValueError, match=re.escape(
            "boundary.marker is null and no boundary.token_id is given, so the stage boundary could never be found: "
            "give a marker string (the default is '</think>') or a token_id")):
        check_boundary_set({"marker": None, "token_id": None, "occurrence": 1})
    check_boundary_set({"marker": None, "token_id": 7})


def test_config_mistakes_are_refused_when_the_workflow_is_parsed(tmp_path):
    tiny_config(tmp_path, boundary={"marker": ";", "token_id": 7})
    proc = snakemake(tmp_path, "--dry-run", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "boundary.marker ';' and boundary.token_id 7 are both set" in out, out[-3000:]
    tiny_config(tmp_path, boundary={"marker": None})
    proc = snakemake(tmp_path, "--dry-run", "--no-hooks", check=False)  # when parsed, not only by the preflight
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "boundary.marker is null and no boundary.token_id is given" in out, out[-3000:]
    tiny_config(tmp_path, prompt={"template": "Q:{problem}="})
    proc = snakemake(tmp_path, "--dry-run", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "has the placeholder {problem}" in out, out[-3000:]
    assert not (tmp_path / "results").exists()


# --- 4. unreadable datasets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["jsonl", "csv"])
def test_a_dataset_that_is_not_utf8_is_named_with_line_and_byte(tmp_path, source):
    path = tmp_path / f"d.{source}"
    data = (b'{"question": "1+1", "answer": "2"}\n{"question": "caf\xff", "answer": "2"}\n' if source == "jsonl"
            else b"question,answer\ncaf\xff,2\n")
    path.write_bytes(data)
    offset = data.index(b"\xff")
    with pytest.raises(DatasetError, match=rf"d.{source}: line 2 \(byte offset {offset}\) is not UTF-8 "
                                           r"\(byte 0xff\); save it as UTF-8 \(for example iconv"):
        load_source({"source": source, "path": str(path)})
    path.write_bytes("question,answer\n1+1,2\n".encode("utf-16"))
    with pytest.raises(DatasetError, match=rf"d.{source}: the file is UTF-16 .*iconv -f utf-16 -t utf-8"):
        load_source({"source": source, "path": str(path)})
    path.write_bytes("question,answer\n1+1,2\n".encode("utf-16-le"))  # no byte-order mark: NULs between letters
    with pytest.raises(DatasetError, match=rf"d.{source}: line 1 \(byte offset 1\) holds a NUL byte: the file "
                                           "looks like UTF-16"):
        load_source({"source": source, "path": str(path)})


def test_a_dataset_path_that_is_a_directory_says_so(tmp_path):
    for source in ("jsonl", "csv", "parquet"):
        with pytest.raises(DatasetError, match=r"dataset.path '.*' is a directory, not a file; point dataset.path "
                                               "at the dataset file inside it"):
            load_source({"source": source, "path": str(tmp_path)})


# --- 5. valid values given on the command line ---------------------------------------------------------------

def test_nested_command_line_values_are_typed_by_the_schema():
    # What Snakemake's --config parser hands over: every scalar inside a nested value is a string.
    given = {"bridge": {"n_rows": "2", "seed": "0"}, "boundary": {"token_id": "null", "occurrence": "2"},
             "transplant": {"select": ["12", "item-3"], "revisions": ["primary"], "precision": "null"},
             "prompt": {"template": "Q:{question}=", "system": "~"}, "offline": "false", "n_items": 4}
    typed = typed_command_line_values(given, SCHEMA)
    assert typed == {"bridge": {"n_rows": 2, "seed": 0}, "boundary": {"token_id": None, "occurrence": 2},
                     "transplant": {"select": ["12", "item-3"], "revisions": ["primary"], "precision": None},
                     "prompt": {"template": "Q:{question}=", "system": None}, "offline": False, "n_items": 4}
    cfg = valid_config(**typed)
    assert cfg["bridge"] == {"n_rows": 2, "seed": 0} and cfg["transplant"]["select"] == ["12", "item-3"]
    bad = typed_command_line_values({"bridge": {"n_rows": "two"}}, SCHEMA)
    with pytest.raises(WorkflowError, match="'two' is not of type 'integer'"):  # still refused by name
        valid_config(**bad)
