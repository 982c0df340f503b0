"""Process infrastructure under the stages: how a job's process starts (the warm job server). Knows no stage,
model or result."""
