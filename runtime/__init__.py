"""Baton's runtime: trains a GPT under a plan, with numerics equal to the single-device model.

model.py            the single-device reference GPT (nanoGPT style) and the parameter inventory/init
rng.py              dropout masks as pure functions of (seed, step, layer, op, sample, head, position)
tensor_parallel.py  non-uniform TP communication (dual autograd Functions, padded uneven gather)
tp_layer.py         the tensor-parallel transformer layer (ParallelBlock): any head/FFN split, recompute segments
stage.py            one rank's part of the model: its layers, the embedding and head at the pipeline's ends
slicing.py          which slice of each full parameter a rank holds (checkpoints, loading full weights)
meters.py           operator calls, recompute time and saved activation bytes, measured while training
topology.py         plan devices -> ranks, stage pairing, process groups
engine.py           the 1F1B step, gradient sync, AdamW, StepStats
replica_sync.py     gradient sync over baton.peers' peer groups: all-reduces, or ZeRO-1 reduce-scatter/all-gather
sharded_optimizer.py  AdamW over the owned shards at zero_stage 1 (fp32 master shards in mixed precision)
host_memory.py      keep freed host memory in the process, so a CPU step's speed does not depend on its history
data.py             byte-level text or synthetic tokens addressed by sample position
checkpoint.py       plan-independent checkpoints (full tensors, safetensors), atomic writes
hf.py               Hugging Face GPT-2 import
launch.py           spawning ranks (or running under torchrun), error reporting
commands.py         `baton train`
profile_command.py  the measured branch of `baton profile` (--device, --comm)
"""
