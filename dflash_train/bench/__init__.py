"""Benchmarks: training throughput and MFU on synthetic workloads, in one process (training) and
under torchrun (distributed), with what they build on (workloads, harness), the useful-FLOP count
(flops) and the profile window (profile); the decoding engine's speed (decoding); and the memory
planner of training layouts (memory). Imports the layers below it (core, engine, data, train,
eval), never app."""
