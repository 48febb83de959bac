"""Evaluation: served tau and speedup on prompt sets (evaluate, prompts), walked tau on data
(walk), what a training run measures at its evaluation steps (during_training), and the reports
they write (results). Imports core, engine, data and train, never bench or app."""
