"""Small trained demo models: the synthetic tasks they learn (`data`), their training (`train`,
torch + transformers, never imported by the engine) and where the shipped one lives (`path`).
`python -m qvl.demo --help`; docs/demo-models.md says what they are and are not."""
