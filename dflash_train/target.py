"""The frozen target: device and dtype choice, loading, capture of the tapped layers.

Owns everything the drafter needs from the target model: its embedding and lm_head weights
(frozen, shared, never saved with the drafter; `TargetHeads` reads them alone for a drafter
rank), and the outputs of the tapped decoder layers for a padded batch (computed only up to the
last tapped layer unless the objective needs the target's own predictions: its greedy token,
or its final hidden state for distillation). Packing those outputs for the drafter is
produce.py's.

Batches are right-padded, so with causal attention no real token ever attends to padding and
the target runs without an attention mask.

Shape legend: b rows, L padded length, H hidden size, F = n*H concatenated tap width, V vocabulary.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from dflash_train.config import BUNDLED_TARGET, QWEN_CODER_TARGET, TINY_TARGET, runs_whole_target
from dflash_train.engine_attention import CAUSAL_ATTENTION, UseAttention, has_sliding_layers, register_attention
from dflash_train.errors import InputError, MissingPath


def resolve_target_path(path: str, setting: str = "target.path") -> Path:
    """A local HF folder, or the bundled SmolLM2-135M-Instruct (converted on first use);
    `setting` names the option in errors."""
    if path == BUNDLED_TARGET:
        from dflash_train.assets import smollm2_dir

        return smollm2_dir()
    if path == TINY_TARGET:
        from dflash_train.assets import tiny_random_target_dir

        return tiny_random_target_dir()
    if path == QWEN_CODER_TARGET:
        from dflash_train.assets import qwen2_5_coder_dir

        return qwen2_5_coder_dir()
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        what = "no such folder" if not p.is_dir() else "not a Hugging Face model folder (no config.json)"
        raise MissingPath(f"{setting} {path}: {what}; give the local folder of your target, or '{BUNDLED_TARGET}'")
    return p


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """auto -> cuda when one is visible, else cpu; `setting` names the option in errors."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{setting}=cuda but no CUDA device is visible: use {setting}=auto or cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA (the target's and the published drafters' dtype), float32 on CPU."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_target_model(path: str, device: torch.device, dtype: str | torch.dtype = "auto"):
    """The target (every layer and the lm_head) and its tokenizer: frozen, eval mode, on
    `device`. Training, evaluation and regeneration all load it here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_target_path(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype, device), attn_implementation="sdpa")
    return model.to(device).eval().requires_grad_(False), AutoTokenizer.from_pretrained(folder)


def decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder module of a causal LM and its stack of layers."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__}: cannot find its decoder layer stack (expected "
            f"model.get_decoder().layers); this architecture is not supported yet"
        )
    return decoder, layers


class LayerTaps:
    """Forward hooks keeping the outputs of chosen decoder layers (before the final norm: HF
    `hidden_states[i + 1]` for layer i < L - 1), concatenated in tap order. The one definition
    of "the target's features", for training capture and speculative decoding alike."""

    def __init__(self, model, layer_ids: list[int]) -> None:
        self.layer_ids = [int(i) for i in layer_ids]
        self.outputs: dict[int, torch.Tensor] = {}
        _, layers = decoder_layers(model)
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layer_ids))]

    def _hook(self, index: int):
        def hook(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def features(self, concat: bool = True) -> torch.Tensor | list[torch.Tensor] | None:
        """[..., T, F] of the last forward (then forgotten), or with concat=False the tapped
        layers' [..., T, H] outputs in tap order; None when nothing is tapped."""
        if not self.layer_ids:
            return None
        parts = [self.outputs[i] for i in self.layer_ids]
        self.outputs.clear()
        return torch.cat(parts, dim=-1) if concat else parts

    def __enter__(self) -> "LayerTaps":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.outputs.clear()


def capture_attention(model) -> str | None:
    """The attention a capture runs the target's layers with: the engine's CAUSAL_ATTENTION when
    the model would use SDPA with nothing but the causal mask (no sliding-window or chunked
    layers), else None (the model's own). A capture's rows are right-padded samples at positions
    0..L-1, so causal attention is all their mask is; with SDPA's own name, transformers would
    first check the position ids for packed sequences, a host sync in every target forward
    (`masking_utils.find_packed_sequence_indices`), and then pass no mask all the same. Same
    kernels (SDPA, causal, grouped heads), same numbers."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or has_sliding_layers(config) \
            or getattr(config, "attention_chunk_size", None) is not None:
        return None
    register_attention()
    return CAUSAL_ATTENTION


class Target:
    """A frozen causal LM that returns the outputs of its tapped layers, and what
    `objective.labels` (`labels`) needs of its last layer: nothing (data), its greedy token
    (target) or its final hidden state (distill)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], labels: str = "data") -> None:
        if labels not in ("data", "target", "distill"):  # e.g. a bool (the former need_logits): loud, not silent
            raise ValueError(f"labels must be objective.labels (data, target or distill), got {labels!r}")
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = [int(i) for i in layer_ids]
        self.labels = labels
        self.decoder, layers = decoder_layers(model)
        self.num_layers = len(layers)
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"tapped layers {bad} do not exist: the target has {self.num_layers} layers")
        if not runs_whole_target(labels):
            # Nothing after the last tapped layer is ever needed: drop it (time and memory).
            self.decoder.layers = nn.ModuleList(list(layers)[: max(self.layer_ids) + 1])
        self.taps = LayerTaps(model, self.layer_ids)
        self.attention = capture_attention(model)
        self.embed_weight = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        self.lm_head_weight = head.weight if head is not None else self.embed_weight

    @torch.no_grad()
    def capture(self, input_ids_bL: torch.Tensor, concat: bool = True):
        """features [b, L, n*H] of the tapped layers (in tap order; concat=False: a list of n
        [b, L, H]), and what the labels need past them: None (data), the greedy next-token
        prediction at every position [b, L] (target), or the final hidden state (after the
        final norm, what the lm_head reads) at every position [b, L, H] (distill)."""
        if self.attention is None:
            out = self.decoder(input_ids=input_ids_bL, use_cache=False)
        else:
            with UseAttention(self.model, self.attention):
                out = self.decoder(input_ids=input_ids_bL, use_cache=False)
        features = self.taps.features(concat)
        if self.labels == "distill":
            return features, out.last_hidden_state
        greedy = None
        if self.labels == "target":
            last = out.last_hidden_state
            greedy = torch.empty(last.shape[:2], dtype=torch.long, device=last.device)
            rows = 1024  # lm_head in chunks of positions: never [b, L, V] logits at once
            flat, flat_out = last.reshape(-1, last.shape[-1]), greedy.view(-1)
            for s in range(0, flat.shape[0], rows):
                flat_out[s : s + rows] = (flat[s : s + rows] @ self.lm_head_weight.t()).argmax(-1)
        return features, greedy

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_weight)


class GraphedTarget:
    """`Target.capture` replayed from CUDA graphs, one per batch shape of the batch plan
    (`target.cuda_graphs`). For a small target the forward costs the host as much as the GPU: a
    launch per kernel of every layer, the hooks, the compiled layers' guards (SmolLM2's 28 kept
    layers on one H200: about 10 ms of host time for about 10 ms of kernels per batch); a replay
    is one launch, and the host's time goes to the drafter's step instead.

    `prepare(shapes, concat)` (the producer's warm-up, with every (rows, L) the plan's batches
    have) runs each shape once eagerly (layers compiled, kernels chosen, output sizes known),
    checks once that the forward never makes the host wait for the GPU (a forward that does
    cannot be captured: then nothing is, the target runs eagerly and the log says why), and
    captures each shape through `decode.Graphs` (the engine's graph keeper: a warm-up run on a
    side stream, one memory pool shared by all graphs, the garbage collector held off during a
    capture). A replay runs the same kernels on the same shapes as the eager forward: the same
    numbers. Shapes not prepared run eagerly. A capture that fails all the same stops the
    warm-up with an error that names the switch: after a failed capture the process's CUDA
    state (its random generators' capture bookkeeping, say) cannot be trusted.

    The graphs write their outputs into one set of buffers of the largest shape's size, and
    `capture` returns copies of them: what it returns may be kept across later calls, as the
    eager forward's outputs, and the graphs' own memory stays one shape's intermediates plus
    one output set. `target` is a `Target` (or anything with its capture).
    """

    def __init__(self, target, device: torch.device, log=print) -> None:
        from dflash_train.decode import Graphs

        self.target, self.log, self.device = target, log, torch.device(device)
        self.graphs = Graphs(self.device)
        self.steps: dict[tuple[int, int, bool], tuple] = {}  # (rows, L, concat) -> fn, layout
        self.refused: str | None = None  # why the forward cannot be captured (it waits on the GPU)

    def __getattr__(self, name):  # embed, lm_head_weight, layer_ids, ... of the wrapped target
        return getattr(self.target, name)

    @torch.no_grad()
    def prepare(self, shapes: list[tuple[int, int]], concat: bool = True) -> None:
        """Warm up and capture every (rows, L) of `shapes`."""
        keys = [k for k in dict.fromkeys((int(r), int(L), bool(concat)) for r, L in shapes) if k not in self.steps]
        sizes: list[tuple[int, torch.dtype]] = []  # per output tensor: most elements, dtype
        layouts = {}
        for rows, L, concat_ in keys:
            features, head_out = self.target.capture(self._zeros(rows, L), concat_)
            split = isinstance(features, (list, tuple))
            layouts[(rows, L, concat_)] = (len(features) if split else None, head_out is not None)
            for i, t in enumerate(_flat((features, head_out))):
                if i == len(sizes):
                    sizes.append((0, t.dtype))
                sizes[i] = (max(sizes[i][0], t.numel()), t.dtype)
            del features, head_out
        if not keys or self.refused is not None:
            return
        self.refused = self._host_wait(*keys[0])
        if self.refused is not None:
            self.log(f"target.cuda_graphs: the target's forward makes the host wait for the GPU ({self.refused}), "
                     "so it cannot be captured as a CUDA graph; the target runs without graphs")
            return
        buffers = [torch.empty(n, dtype=dtype, device=self.device) for n, dtype in sizes]
        for key in keys:
            fn = self._writer(key[2], buffers)
            try:
                self.graphs.run(key, fn, self._zeros(*key[:2]))
            except RuntimeError as err:
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise InputError(
                    f"target.cuda_graphs: capturing the target's forward for batches of shape {key[:2]} as a CUDA "
                    f"graph failed ({first}); set target.cuda_graphs=false to train without graphs") from err
            self.steps[key] = (fn, layouts[key])

    @torch.no_grad()
    def capture(self, input_ids_bL: torch.Tensor, concat: bool = True):
        key = (*map(int, input_ids_bL.shape), bool(concat))
        entry = self.steps.get(key)
        if entry is None:
            return self.target.capture(input_ids_bL, concat)
        fn, (num_split, has_head) = entry
        copies = [out.clone() for out in self.graphs.run(key, fn, input_ids_bL)]
        head_out = copies.pop() if has_head else None
        return (copies if num_split is not None else copies[0]), head_out

    def _host_wait(self, rows: int, L: int, concat: bool) -> str | None:
        """The first line of what CUDA's sync debug mode raises when the forward makes the host
        wait for the GPU (an item(), a nonzero, a copy to the host), or None. On CPU there is no
        such mode: the forward just runs (tests make it raise)."""
        cuda = self.device.type == "cuda"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the debug mode's own notice that it is a prototype
            if cuda:
                torch.cuda.set_sync_debug_mode("error")
            try:
                self.target.capture(self._zeros(rows, L), concat)
            except RuntimeError as err:
                return str(err).splitlines()[0] if str(err) else type(err).__name__
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        return None

    def _zeros(self, rows: int, L: int) -> torch.Tensor:
        return torch.zeros(rows, L, dtype=torch.long, device=self.device)

    def _writer(self, concat: bool, buffers: list[torch.Tensor]):
        """The captured step: the target's forward, its outputs written into the shared buffers."""
        def step(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
            outs = _flat(self.target.capture(ids, concat))
            return tuple(buf[: t.numel()].view(t.shape).copy_(t) for t, buf in zip(outs, buffers))

        return step


def _flat(outputs) -> list[torch.Tensor]:
    """(features, head_out) of Target.capture as a flat list of tensors (features may be a list
    of per-tap tensors; head_out may be None)."""
    features, head_out = outputs
    flat = list(features) if isinstance(features, (list, tuple)) else [features]
    return flat + ([] if head_out is None else [head_out])


def load_target(path: str, device: torch.device, dtype: str, layer_ids: list[int],
                labels: str = "data") -> tuple[Target, object]:
    """Load, freeze and wrap the target (`labels`: objective.labels); returns (Target, tokenizer)."""
    model, tokenizer = load_target_model(path, device, dtype)
    return Target(model, layer_ids, labels), tokenizer


class TargetHeads:
    """The target's frozen embedding and lm_head without its layers: what a drafter rank of a
    disaggregated run needs. Read from the checkpoint's safetensors files by name, so the
    decoder layers are never loaded."""

    def __init__(self, path: str, device: torch.device, dtype: str) -> None:
        import json

        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        folder = resolve_target_path(path)
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        names: dict[int, list[str]] = {}  # tied weights have several names; the file holds one
        for n, p in skeleton.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        embed = skeleton.get_input_embeddings().weight
        head = skeleton.get_output_embeddings()
        wanted = {"embed": names[id(embed)]}
        if head is not None and head.weight is not embed:
            wanted["head"] = names[id(head.weight)]
        index = folder / "model.safetensors.index.json"
        files = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
        torch_dtype = resolve_dtype(dtype, device)
        found = {}
        for role, candidates in wanted.items():
            for name in candidates:
                file = folder / files.get(name, "model.safetensors")
                if not file.is_file():
                    continue
                with safe_open(str(file), framework="pt") as f:
                    if name in f.keys():
                        found[role] = f.get_tensor(name).to(device, torch_dtype)
                        break
            if role not in found:
                raise KeyError(f"{folder}: no safetensors file holds the target's {role} weight "
                               f"(looked for {candidates})")
        self.embed_weight = found["embed"]
        self.lm_head_weight = found.get("head", self.embed_weight)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_weight)
