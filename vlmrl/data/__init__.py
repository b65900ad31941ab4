"""Prompt data: verl/EasyR1-schema parquet datasets (`dataset`), their resumable batch order, and the embedded visual
tasks (`synthetic`)."""
