"""`qvl eval`: the accuracy and speed of a model on a labelled set, for several configurations.

labels (the JSONL format, checked line by line) -> run (each configuration through the batch
path: qvl.batch.process.Worker on the scheduler; another CPU tier in a process of its own)
-> metrics (exact match, character error rate, box IoU, point hits) -> table and JSON.
"""
