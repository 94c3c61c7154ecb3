"""Training pipeline: offline corpora, tokenizer, target pretraining (drafter training reuses `loop`).

Modules: `synth` (generated math and chat data), `data` (corpora, splits, packed token stream),
`loop` (DDP, schedule, checkpoints, progress and JSON log), `target` (target pretraining),
`cli` (the `dflow-rt train ...` commands).
"""
