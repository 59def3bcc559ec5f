"""The Ray actor that owns one GraphEncoder on one GPU (planned)."""
