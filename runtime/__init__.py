"""Baton's runtime: trains a model under a plan, with numerics equal to the single-device model.

model/     the single-device reference GPT (nanoGPT style), dropout masks as pure functions of where they
           are drawn, Hugging Face import and export, sampling
parallel/  non-uniform tensor parallelism (communication, the parallel layer, the vocabulary-parallel
           embedding and head), each rank's slices and stage, plan devices as ranks and groups
train/     the step: one interpreter of baton.schedules (1F1B, interleaved 1F1B, layer by layer), gradient
           sync over peer groups, AdamW (sharded at ZeRO stages 1-3, fp32 masters in mixed precision),
           optimisation settings, plan-independent checkpoints
data/      tokenizers and prepared token datasets, the samples each rank reads
launch/    one process per plan device (or under torchrun), a machine's part of a run across machines (plan
           ranks after the rendezvous, re-planning for lost machines), devices and the pre-flight memory
           check, processes that end with the run, core pinning, host memory kept for reuse
measure/   operator tables and link fits for the cost model, meters inside a step, metrics, traces,
           the measured-against-predicted report
commands/  `baton train`, `baton launch --print`, `baton data prepare`, `baton export`, `baton generate`,
           `baton profile --device` and `--comm --peer`
"""
