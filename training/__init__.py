"""The training engine: pure PyTorch + transformers + peft, no Django.

Entry points: `training.engine.Engine` (base model, tokenizer, LoRA host, policies),
`training.ops` (forward, forward_backward, optim_step), `training.sampler` (sample,
compute_logprobs), `training.rl` (advantages, trajectories to datums), `training.types`.
Submodules are imported explicitly so that `import training` stays cheap.
"""
