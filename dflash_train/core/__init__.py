"""The core: configuration, errors, bundled assets, the frozen target, the one mask rule, the
objective and acceptance count, the drafter and its published format. Imports nothing above it."""
