"""`qvl batch`: one prompt over many images into an append-only, resumable JSONL file.

inputs (folder / glob / JSONL -> items with stable ids) -> process (engine -> result rows)
-> output (whole-line, fsynced JSONL writer; repair and resume) -> runner (local loop,
progress, summary, exit status) or ray_runner (the same rows from a Ray Data actor pool).
"""
