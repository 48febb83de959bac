"""The frozen target: device and dtype choice, loading, capture of the tapped layers.

Owns everything the drafter needs from the target model: its embedding and lm_head weights
(frozen, shared, never saved with the drafter; `TargetHeads` reads them alone for a drafter
rank), and the outputs of the tapped decoder layers for a padded batch (computed only up to the
last tapped layer unless the objective needs the target's own predictions: its greedy token,
or its final hidden state for distillation). Packing those outputs for the drafter is
produce.py's. A target may also be loaded tensor parallel over the ranks of one target group
(topology.target_tp: transformers' own plan of its model type, checked first by
`tensor_parallel_problems`); what leaves it (taps, final state, embedding and lm_head weights)
is whole and replicated on every rank of the group (`whole`).

Batches are right-padded, so with causal attention no real token ever attends to padding and
the target runs without an attention mask.

Shape legend: b rows, L padded length, H hidden size, F = n*H concatenated tap width, V vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DistributedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from dflash_train.core.assets import qwen2_5_coder_dir, smollm2_dir, tiny_random_target_dir
from dflash_train.core.attention import CAUSAL_ATTENTION, UseAttention, has_sliding_layers, register_attention
from dflash_train.core.config import BUNDLED_TARGET, QWEN_CODER_TARGET, TINY_TARGET, runs_whole_target
from dflash_train.core.devices import resolve_dtype, whole
from dflash_train.core.errors import InputError, MissingPath

# A tokenizer's own files: tokenizer.json alone is a whole fast tokenizer; the others are the
# vocabularies of the slow ones (sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# Model classes whose name says causal LM (AutoModelForCausalLM loads them).
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
# The sizes a tensor-parallel target splits evenly over the ranks of its group: transformers'
# plans shard attention by heads (query and key/value), the MLPs and experts by their
# intermediate size, and the lm_head by vocabulary rows.
TP_SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "vocab_size")


class TargetFolderError(InputError):
    """A target folder that cannot be used, every problem on its own line (exit 2)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(problems[0] if len(problems) == 1 else "\n".join(problems))


def resolve_target_path(path: str, setting: str = "target.path", weights: bool = True,
                        tokenizer: bool = True) -> Path:
    """A local HF folder, or the bundled SmolLM2-135M-Instruct (converted on first use);
    `setting` names the option in errors. A local folder is checked before anything loads it
    (`target_folder_problems`; `weights=False`: a tokenizer is all the caller reads; with
    `tokenizer=False` too, its config alone)."""
    if path == BUNDLED_TARGET:
        return smollm2_dir()
    if path == TINY_TARGET:
        return tiny_random_target_dir()
    if path == QWEN_CODER_TARGET:
        return qwen2_5_coder_dir()
    p = Path(path).expanduser()
    if path.startswith("bundled:") and not p.exists():
        raise MissingPath(f"{setting} {path}: no such bundled target; the bundled ones are "
                          f"{', '.join((BUNDLED_TARGET, QWEN_CODER_TARGET, TINY_TARGET))}, or give the local folder of "
                          f"your target")
    if not (p / "config.json").is_file():
        what = "no such folder" if not p.is_dir() else "not a Hugging Face model folder (no config.json)"
        raise MissingPath(f"{setting} {path}: {what}; give the local folder of your target, or '{BUNDLED_TARGET}'")
    problems = [f"{setting} {path}: {problem}" for problem in target_folder_problems(p, weights, tokenizer)]
    if problems:
        raise TargetFolderError(problems)
    return p


def _folder_signature(folder: Path) -> tuple:
    """(name, size, mtime) of a folder's files: a check's result is reused until one changes."""
    return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder) if e.is_file()))


def target_folder_problems(folder: Path, weights: bool = True, tokenizer: bool = True) -> list[str]:
    """What makes `folder` (it has a config.json) unusable as a target, one problem a line, read
    from the files alone (nothing is loaded): its config (valid JSON, a causal LM, not a DFlash
    drafter), with `tokenizer` its tokenizer files, and with `weights` its weight files, the header
    of every safetensors file read and checked against the file's size (a file cut short fails)."""
    folder = Path(folder)
    return list(_folder_problems(str(folder.resolve()), _folder_signature(folder), weights, tokenizer))


@functools.lru_cache(maxsize=16)
def _folder_problems(folder: str, signature: tuple, weights: bool, tokenizer: bool) -> tuple[str, ...]:
    path = Path(folder)
    problems = _config_problems(path / "config.json")
    if tokenizer:
        problems += _tokenizer_problems(path)
    if weights:
        problems += _weight_problems(path)
    return tuple(problems)


def _read_json(file: Path) -> tuple[object, str | None]:
    """(the JSON of `file`, None) or (None, what is wrong with it)."""
    try:
        return json.loads(file.read_bytes()), None
    except OSError as err:
        return None, f"{file.name} cannot be read ({err.strerror or err})"
    except ValueError as err:
        return None, f"{file.name} is not valid JSON ({err}): copy it from the model again"


def _config_problems(file: Path) -> list[str]:
    raw, problem = _read_json(file)
    if problem:
        return [problem]
    if not isinstance(raw, dict):
        return [f"{file.name} is not a JSON object: copy it from the model again"]
    if "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or []):
        return ["is a DFlash drafter folder, not a target model: give the model the drafter drafts for (a "
                "drafter goes to --drafter or drafter.init_from)"]
    kind, classes = raw.get("model_type"), [str(a) for a in raw.get("architectures") or []]
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return [f"model_type {kind!r} is not a causal language model that transformers loads "
                f"(AutoModelForCausalLM): give a causal LM's folder (Llama, Qwen2/3, SmolLM2, ...)"]
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if classes and not any(c in causal or c.endswith(CAUSAL_SUFFIXES) for c in classes):
        return [f"its architectures {classes} are not a causal language model (a {classes[0]} has no next-token "
                f"head to draft for): give a causal LM's folder"]
    return []


def _tokenizer_problems(folder: Path) -> list[str]:
    found = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not found:
        return [f"no tokenizer ({', '.join(TOKENIZER_FILES[:2])} or a vocabulary file): copy the target's "
                f"tokenizer files into the folder"]
    problems = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            problems += [p for p in [_read_json(folder / name)[1]] if p]
    return problems


def weight_files(folder: Path) -> list[Path]:
    """A model folder's weight files: its safetensors files, then its PyTorch .bin ones."""
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))


def weight_bytes(folder: Path) -> int:
    """Bytes of the weights a model folder loads: its safetensors files where it has any (what
    transformers reads first), else its PyTorch .bin files."""
    files = weight_files(Path(folder))
    return sum(path.stat().st_size for path in [f for f in files if f.suffix == ".safetensors"] or files)


def _weight_problems(folder: Path) -> list[str]:
    """Missing, unreadable or damaged weight files (safetensors headers; PyTorch zip files)."""
    files = weight_files(folder)
    problems = []
    for index in sorted(folder.glob("*.index.json")):
        raw, problem = _read_json(index)
        shards = set((raw or {}).get("weight_map", {}).values()) if isinstance(raw, dict) else set()
        if problem or not shards:
            problems.append(problem or f"{index.name} lists no weight files: copy it from the model again")
        problems += [f"{shard} is missing (listed in {index.name}): copy the model's weight files again"
                     for shard in sorted(shards) if not (folder / shard).is_file()]
    if not files and not problems:
        return ["no weights (model.safetensors, or shards listed in model.safetensors.index.json): copy the "
                "target's weight files into the folder"]
    for file in files:
        problem = _weight_file_problem(file)
        if problem:
            problems.append(f"{file.name} {problem}: the file is damaged or cut short; copy it again")
    return problems


def _weight_file_problem(file: Path) -> str | None:
    if not os.access(file, os.R_OK):
        return "cannot be read (permission denied)"
    if file.suffix == ".bin":
        return None if zipfile.is_zipfile(file) else "is not a PyTorch weight file"
    try:  # the header, and its offsets against the file's size
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as err:  # noqa: BLE001 - safetensors raises its own and OS errors
        return f"is not a readable safetensors file ({type(err).__name__}: {err})"
    return None


def load_tokenizer(folder: Path, setting: str = "target.path"):
    """The tokenizer of a target folder; one that does not load is the user's mistake, said in
    a line (InputError)."""
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - tokenizer classes raise anything on bad files
        raise InputError(f"{setting} {folder}: its tokenizer does not load ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}): copy the target's tokenizer files "
                         f"again") from err


def load_target_model(path: str, device: torch.device, dtype: str | torch.dtype = "auto",
                      tp_mesh: DeviceMesh | None = None):
    """The target (every layer and the lm_head) and its tokenizer: frozen, eval mode, on
    `device`. Training, evaluation and regeneration all load it here. With `tp_mesh` (a 1-D mesh
    of the ranks of one target group, topology.target_tp) the target is loaded tensor parallel
    over it by transformers' own plan of its model type, each rank reading its shards alone."""
    folder = resolve_target_path(path)
    tokenizer = load_tokenizer(folder)
    sharding = {} if tp_mesh is None else tensor_parallel_loading(tp_mesh)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype, device), attn_implementation="sdpa",
                                                 **sharding)
    if tp_mesh is not None:  # the group's size, where loading had to be told the world's (below)
        model._tp_size = model.config.distributed_config.tp_size = tp_mesh.size()
    return model.to(device).eval().requires_grad_(False), tokenizer


def tensor_parallel_loading(tp_mesh: DeviceMesh) -> dict:
    """from_pretrained's arguments for a target sharded over `tp_mesh` by its model type's plan.
    The mesh decides the sharding (which ranks, which shard is this rank's); transformers also
    requires DistributedConfig.tp_size to be the world size, which a group of some of the ranks
    is not (disaggregated runs, several groups), so it is told that and corrected after loading."""
    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size()),
            "device_mesh": tp_mesh}


def tensor_parallel_problems(config, tp: int, setting: str = "topology.target_tp") -> list[str]:
    """Why the target of transformers config `config` cannot run tensor parallel over `tp` ranks
    (read from its config alone, before anything loads): its model type ships no plan, or a size
    the plan splits is not a multiple of `tp`."""
    if tp <= 1:
        return []
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        return [f"{setting}={tp}: the target's model type {text.model_type!r} has no tensor-parallel plan in "
                f"transformers (its config's base_model_tp_plan is empty): set {setting}=1 for this target"]
    return [f"{setting}={tp}: the target's {name} ({value}) is not a multiple of {tp}, so its shards would be "
            f"uneven: choose a {setting} that divides it" for name in TP_SPLIT_SIZES
            if isinstance(value := getattr(text, name, None), int) and value % tp]


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
            self.outputs[index] = whole(output[0] if isinstance(output, tuple) else output)

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
        # A tensor-parallel target (topology.target_tp) holds shards of its weights; the drafter
        # and the greedy labels read whole ones, gathered once here.
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
        with torch.no_grad():
            self.embed_weight = whole(embed)
            self.lm_head_weight = whole(head.weight) if head is not None and head.weight is not embed \
                else self.embed_weight

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
            return features, whole(out.last_hidden_state)
        greedy = None
        if self.labels == "target":
            last = whole(out.last_hidden_state)
            greedy = torch.empty(last.shape[:2], dtype=torch.long, device=last.device)
            rows = 1024  # lm_head in chunks of positions: never [b, L, V] logits at once
            flat, flat_out = last.reshape(-1, last.shape[-1]), greedy.view(-1)
            for s in range(0, flat.shape[0], rows):
                flat_out[s : s + rows] = (flat[s : s + rows] @ self.lm_head_weight.t()).argmax(-1)
        return features, greedy

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_weight)


def load_target(path: str, device: torch.device, dtype: str, layer_ids: list[int],
                labels: str = "data", tp_mesh: DeviceMesh | None = None) -> tuple[Target, object]:
    """Load, freeze and wrap the target (`labels`: objective.labels; `tp_mesh`: its target group's
    mesh, load_target_model); returns (Target, tokenizer)."""
    model, tokenizer = load_target_model(path, device, dtype, tp_mesh)
    return Target(model, layer_ids, labels), tokenizer


def target_config_of(path: str, setting: str = "target.path"):
    """The transformers config of a target: a folder's config.json alone (no tokenizer or weights
    needed, checked as every command checks a target: resolve_target_path), or a bundled target's
    (converted on first use); refused in one line where it is not a decoder language model's."""
    folder = resolve_target_path(path, setting, weights=False, tokenizer=False)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, KeyError) as err:  # transformers' words for a config it cannot read
        raise InputError(f"{setting} {path}: its config.json does not load ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}): copy it from the model again") from err
    text = config.get_text_config()
    missing = [f for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(getattr(text, f, None), int)]
    if missing:
        raise InputError(f"{setting} {path}: its config.json lacks {', '.join(missing)}: the planner and the bench "
                         f"read decoder language models (Llama, Mistral, Qwen, Mixtral families and alike)")
    return config


class TargetHeads:
    """The target's frozen embedding and lm_head without its layers: what a drafter rank of a
    disaggregated run needs. Read from the checkpoint's safetensors files by name, so the
    decoder layers are never loaded."""

    def __init__(self, path: str, device: torch.device, dtype: str) -> None:

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
