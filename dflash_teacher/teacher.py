"""The teacher forward: tapped-layer hidden states and top-k next-token log-probs per position.

Only the tapped layers are captured (forward hooks), never all hidden states, and the LM head runs
over chunks of positions so ``[tokens, vocab]`` fp32 logits for a whole batch never exist.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from dflash_common.devices import bind_device, resolve_device
from dflash_common.errors import ConfigError, TeacherError
from dflash_common.settings_files import load_settings_file
from dflash_teacher.chat_template import stop_token_ids
from dflash_teacher.deltanet_kernels import gated_deltanet_note
from dflash_teacher.settings.teacher_config import TeacherConfig
from dflash_teacher.tapped_layers import resolve_layers
from dflash_teacher.teacher_files import IDENTITY_SOURCE, read_tensor, stored_tensors, teacher_folder, text_names, weights_hash

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def plan_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Group sequence indices into batches of similar length within a padded-token budget.

    Longest first, so each batch's first sequence sets its padded length; a sequence longer
    than the budget runs alone. Deterministic for given lengths.
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    batches, current, width = [], [], 0
    for i in order:
        length = int(lengths[i])
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(np.array(current))
            current = []
        if not current:
            width = length
        current.append(int(i))
    if current:
        batches.append(np.array(current))
    return batches


def padding_fraction(lengths: np.ndarray, batches: list[np.ndarray]) -> float:
    padded = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1.0 - float(np.sum(lengths)) / padded if padded else 0.0


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.base_model
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return layers
    n = model.config.get_text_config().num_hidden_layers
    for module in base.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise TeacherError(f"cannot find the decoder layers of {type(model).__name__}; the model type is not supported")


class LayerTaps:
    """What a tapped hidden state is, for the build and for decoding alike: the output of decoder
    layer i (before any later layer or the final norm), captured by forward hooks while the
    context is open. `keep` picks what to keep of each output (the build keeps the real,
    unpadded positions)."""

    def __init__(self, model, layer_ids, keep=None):
        self.layers = decoder_layers(model)
        self.layer_ids = tuple(layer_ids)
        self.keep = keep
        self.captured: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> "LayerTaps":
        def hook(layer_id: int):
            def save(_module, _inputs, output):
                state = output[0] if isinstance(output, tuple) else output
                self.captured[layer_id] = self.keep(state) if self.keep is not None else state
            return save

        self.handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def take(self, device: torch.device | None = None) -> torch.Tensor:
        """The latest forward's states stacked on a new second-to-last axis ([..., L, H]), on
        `device` (default: the first tapped layer's; with a device_map the layers may sit on
        different GPUs), and forgotten."""
        device = device if device is not None else self.captured[self.layer_ids[0]].device
        hidden = torch.stack([self.captured[i].to(device) for i in self.layer_ids], dim=-2)
        self.captured.clear()
        return hidden


def tokenizer_hashes(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return {
        "hash": xxhash.xxh64(text.encode()).hexdigest(),
        "chat_template_hash": xxhash.xxh64((tokenizer.chat_template or "").encode()).hexdigest(),
        "size": len(tokenizer),
    }


def _config_hash(config) -> str:
    config = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_commit_hash"):
        config.pop(volatile, None)
    return xxhash.xxh64(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def teacher_identity(config, name_or_path: str, revision: str | None, tensors: dict, vocab_size: int) -> dict:
    """Name, revision and hashes of the config and of the weight files (teacher_files.weights_hash:
    a strided sample of every stored tensor, so hashing a 27B model takes seconds and never loads
    it). The same for both engines: it comes from the files, not from what an engine loaded."""
    text_config = config.get_text_config()
    return {
        "name": name_or_path,
        "revision": revision or getattr(config, "_commit_hash", None),
        "model_type": getattr(text_config, "model_type", config.model_type),
        "num_hidden_layers": int(text_config.num_hidden_layers),
        "hidden_size": int(text_config.hidden_size),
        "vocab_size": int(vocab_size),
        "config_hash": _config_hash(config),
        "weights_hash": weights_hash(tensors),
        "weights_hash_of": IDENTITY_SOURCE,
    }


def legacy_weights_hash(model) -> str:
    """The weights hash of caches built before `weights_hash_of` existed: a strided sample of every
    tensor of the loaded model's state_dict, in the build dtype (needs the whole model loaded)."""
    weights = xxhash.xxh64()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu().numpy()
        weights.update(f"{name}:{tuple(tensor.shape)}".encode())
        weights.update(sample.tobytes())
    return weights.hexdigest()


def identity_like(teacher: "Teacher", recorded: dict | None) -> dict:
    """The teacher's identity hashed the way `recorded` (a cache's manifest teacher) was: a cache
    from before the file hash is compared by its own legacy hash, which needs the whole model in
    this process (the transformers engine); the vLLM engine says so in one line."""
    if not recorded or recorded.get("weights_hash_of") or "weights_hash" not in recorded:
        return teacher.identity
    if not teacher.holds_whole_model:
        raise TeacherError("this cache was started by an older dflash, whose teacher hash needs the whole teacher "
                           "loaded in the build process; resume it with --engine transformers (or rebuild it with "
                           "--overwrite)")
    legacy = {k: v for k, v in teacher.identity.items() if k != "weights_hash_of"}
    return {**legacy, "config_hash": _config_hash(teacher.model.config), "weights_hash": legacy_weights_hash(teacher.model)}


def _pretrained(cfg: TeacherConfig) -> dict:
    """Keyword arguments of every from_pretrained call on a teacher. trust_remote_code is always
    explicit: left unset, transformers asks on stdin, and `yes |` would run the folder's code."""
    return {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}


def _load_error(cfg: TeacherConfig, what: str, err: Exception) -> TeacherError:
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "trust_remote_code" in str(err) and not cfg.trust_remote_code:
        return TeacherError(f"the {what} of {cfg.name_or_path!r} needs code shipped in its folder, which dflash does "
                            "not run unless asked: pass --trust-remote-code if you trust that code")
    return TeacherError(f"cannot load the {what} of {cfg.name_or_path!r}: {first}")


def load_tokenizer(cfg: TeacherConfig):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.name_or_path, **_pretrained(cfg))
    except (OSError, ValueError) as err:
        raise _load_error(cfg, "tokenizer", err) from None


def load_config(cfg: TeacherConfig):
    """The teacher's text config (a vision-language checkpoint's language model's)."""
    return load_full_config(cfg).get_text_config()


def load_full_config(cfg: TeacherConfig):
    from transformers import AutoConfig

    local = os.path.join(os.path.expanduser(cfg.name_or_path), "config.json")
    if os.path.lexists(local):  # transformers reads it whole: a link to /dev/zero would exhaust memory
        load_settings_file(local, f"the teacher's {local}", fix="check the teacher folder")
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, **_pretrained(cfg))
    except (OSError, ValueError) as err:
        raise _load_error(cfg, "teacher config", err) from None


@dataclass
class TeacherOutput:
    """Results for a list of sequences, packed back to back in the order given."""

    hidden: np.ndarray  # stored dtype [N_tokens, L, H]
    topk_ids: np.ndarray  # int32 [N_tokens, k]
    topk_logprobs: np.ndarray  # float32 [N_tokens, k]
    finite: np.ndarray  # bool [n_sequences]


@dataclass
class Teacher:
    """A loaded teacher ready to run; build it with ``load_teacher``."""

    cfg: TeacherConfig
    model: torch.nn.Module
    tokenizer: object
    layer_ids: list[int]
    device: torch.device
    identity: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    """Lines for the user about how this teacher runs (its Gated DeltaNet kernels; for vLLM, a
    version outside the connector's range)."""

    def stop_token_ids(self) -> list[int]:
        """The tokens that end this teacher's answers (chat.stop_token_ids)."""
        return stop_token_ids(self.tokenizer, getattr(self.model.generation_config, "eos_token_id", None))

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.get_text_config().hidden_size)

    @torch.inference_mode()
    def forward(self, sequences: list[np.ndarray]) -> TeacherOutput:
        """Run one padded batch (right padding, so real positions are unaffected)."""
        lengths = torch.tensor([len(s) for s in sequences])
        width = int(lengths.max())
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        for row, seq in enumerate(sequences):
            input_ids[row, : len(seq)] = torch.from_numpy(np.asarray(seq, dtype=np.int64))
        attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        real = attention_mask.bool().to(self.device)

        # only the real positions of each tapped layer are kept, as the layers produce them
        with LayerTaps(self.model, self.layer_ids, keep=lambda state: state[real.to(state.device)]) as taps:
            out = self.model.base_model(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False
            )
        # with a device_map the final norm sits on the last GPU, the mask on the embedding's
        last = out.last_hidden_state[real.to(out.last_hidden_state.device)]  # [N, H]
        hidden = taps.take(last.device)  # [N, L, H]
        return self.pack(hidden, *self._topk(last), lengths)

    # Batches run padded to their longest sequence (plan_batches); an engine that packs sequences
    # says False, and the build counts no padding for it.
    pads_batches = True

    # Whether `model` is the whole teacher (the transformers engine) or only its head pieces
    # (TextHead: the vLLM engine runs the rest elsewhere).
    holds_whole_model = True

    # Shards whose forward may be under way at once in a build (ShardQueue): 1 runs each shard's
    # forward when its outputs are wanted; an engine in another process (vLLM) takes 2, so it runs
    # the next shard while the build receives, checks and writes the previous one.
    shards_in_flight = 1

    def batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        """The sequence indices of each forward of one shard."""
        return plan_batches(lengths, self.cfg.batch_tokens)

    def submit(self, sequences: list[np.ndarray]) -> Callable[[], TeacherOutput]:
        """Start a forward of these sequences; the function returned waits for its outputs. Outputs
        are taken in the order the forwards were submitted. Here nothing runs until they are asked
        for (the forward runs in this process)."""
        return lambda: self.forward(sequences)

    def close(self) -> None:
        """Release what the teacher holds outside this process (nothing: transformers runs here)."""

    def pack(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
             lengths: torch.Tensor) -> TeacherOutput:
        """A forward's results as arrays, with a finite flag per sequence (NaN or Inf anywhere in
        its hidden states or log-probs clears it)."""
        token_finite = torch.isfinite(hidden).flatten(1).all(1) & torch.isfinite(topk_logprobs).all(1).to(hidden.device)
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(token_finite.device)
        finite = torch.ones(len(lengths), dtype=torch.bool, device=token_finite.device)
        finite.scatter_reduce_(0, seq_of_token, token_finite, reduce="amin")

        hidden = hidden.cpu()
        if hidden.dtype == torch.bfloat16:
            hidden_np = hidden.view(torch.int16).numpy().view(np.uint16)
        else:
            hidden_np = hidden.float().numpy()
        return TeacherOutput(
            hidden=hidden_np,
            topk_ids=topk_ids.cpu().to(torch.int32).numpy(),
            topk_logprobs=topk_logprobs.cpu().numpy(),
            finite=finite.cpu().numpy(),
        )

    def _topk(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.model.get_output_embeddings()
        softcap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        last = last.to(head.weight.device)  # the head may sit on another GPU than the final norm
        ids, logprobs = [], []
        for start in range(0, last.shape[0], self.cfg.logits_chunk):
            logits = fp32_logits(last[start:start + self.cfg.logits_chunk], head.weight, head.bias)
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            values, indices = torch.log_softmax(logits, dim=-1).topk(self.cfg.top_k, dim=-1, sorted=True)
            ids.append(indices)
            logprobs.append(values)
        return torch.cat(ids), torch.cat(logprobs)


def final_norm(model) -> torch.nn.Module:
    """The norm between the last decoder layer and the LM head (what makes last_hidden_state)."""
    norm = getattr(model.base_model, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise TeacherError(f"cannot find the final norm of {type(model).__name__}; the model type is not supported by --engine vllm")
    return norm


def fp32_logits(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                vocab_chunk: int = 32768) -> torch.Tensor:
    """states @ weight.T with float32 output for a bf16 (or fp32) LM head. A bf16 result would be
    rounded to bf16 before the softmax: 0.125 apart at |logit| 16-32, up to 0.06 of error in the
    stored log-probs the KL loss learns from. CUDA accumulates in fp32 and returns it directly
    (mm's out_dtype); elsewhere the head is upcast a slice of the vocabulary at a time, so no fp32
    copy of the whole head exists."""
    if weight.dtype == torch.float32:
        out = states.float() @ weight.T
    elif states.is_cuda and weight.dtype == states.dtype:
        try:
            out = torch.mm(states, weight.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch without out_dtype for this pair
            out = _sliced_fp32_logits(states, weight, vocab_chunk)
    else:
        out = _sliced_fp32_logits(states, weight, vocab_chunk)
    return out + bias.float() if bias is not None else out


def _sliced_fp32_logits(states: torch.Tensor, weight: torch.Tensor, vocab_chunk: int) -> torch.Tensor:
    x = states.float()
    out = torch.empty(states.shape[0], weight.shape[0], dtype=torch.float32, device=states.device)
    for start in range(0, weight.shape[0], vocab_chunk):
        out[:, start:start + vocab_chunk] = x @ weight[start:start + vocab_chunk].float().T
    return out


class TextHead(torch.nn.Module):
    """What a build needs of a teacher that another engine runs: its config, final norm and LM head
    (on the device), read by name from the safetensors files; the input embedding is read from the
    files when asked (once, for the frozen teacher files) and not kept. Answers the few model
    methods the build calls (get_input_embeddings, get_output_embeddings, config, generation_config)."""

    def __init__(self, config, generation_config, tensors: dict, names: dict, dtype: torch.dtype,
                 norm: torch.nn.Module, head: torch.nn.Linear):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.norm, self.lm_head = norm, head
        self._tensors, self._names, self._dtype = tensors, names, dtype

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the teacher's files by name: its shape (what vLLM will load, unread here)."""
        return {name: tensor.shape for name, tensor in self._tensors.items()}

    def get_input_embeddings(self) -> torch.nn.Embedding:
        if self._names["embed"] == self._names["head"]:  # tied: the head is the embedding
            return torch.nn.Embedding.from_pretrained(self.lm_head.weight.detach(), freeze=True)
        return torch.nn.Embedding.from_pretrained(read_tensor(self._tensors, self._names["embed"], self._dtype), freeze=True)


def _final_norm_module(config, cfg: TeacherConfig) -> torch.nn.Module:
    """An empty final norm of the teacher's own class (built on the meta device: no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            skeleton = AutoModelForCausalLM.from_config(config.get_text_config(), trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as err:
            raise _load_error(cfg, "model", err) from None
    return final_norm(skeleton)


def load_text_head(cfg: TeacherConfig, device: torch.device) -> tuple[TextHead, dict]:
    """The teacher's TextHead on `device` and its identity, without loading the rest of it."""
    from transformers import GenerationConfig

    config = load_full_config(cfg)
    folder = teacher_folder(cfg.name_or_path, cfg.revision)
    tensors = stored_tensors(folder)
    text_config = config.get_text_config()
    tied = bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    names = text_names(tensors, tied)
    dtype = DTYPES[cfg.dtype]
    weight = read_tensor(tensors, names["head"], dtype, device)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    norm = _final_norm_module(config, cfg).to_empty(device=device)
    norm.load_state_dict({"weight": read_tensor(tensors, names["norm"], dtype, device)})
    norm.to(dtype).eval()
    try:
        generation = GenerationConfig.from_pretrained(cfg.name_or_path, **_pretrained(cfg))
    except (OSError, ValueError):
        generation = None
    identity = teacher_identity(config, cfg.name_or_path, cfg.revision, tensors, weight.shape[0])
    return TextHead(config, generation, tensors, names, dtype, norm, head), identity


def load_teacher(cfg: TeacherConfig, tokenizer=None) -> Teacher:
    from transformers import AutoModelForCausalLM

    if not cfg.device_map:
        device = resolve_device(cfg.device)
        bind_device(device)
    # straight onto its device: never a whole host copy first (a 27B teacher is ~54 GB)
    placement = cfg.device_map or {"": str(device)}
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, dtype=DTYPES[cfg.dtype], device_map=placement,
                                                     **_pretrained(cfg))
    except (OSError, ValueError) as err:
        raise _load_error(cfg, "model", err) from None
    if cfg.device_map:  # inputs go where the embedding lives
        device = model.get_input_embeddings().weight.device
    model.eval()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    if cfg.top_k > model.get_output_embeddings().weight.shape[0]:
        raise ConfigError(f"--top-k {cfg.top_k} exceeds the teacher's vocabulary; use a smaller k")
    return Teacher(
        cfg=cfg,
        model=model,
        tokenizer=tokenizer,
        layer_ids=resolve_layers(cfg, num_layers),
        device=device,
        identity=teacher_identity(load_full_config(cfg), cfg.name_or_path, cfg.revision,
                                  stored_tensors(teacher_folder(cfg.name_or_path, cfg.revision)),
                                  model.get_output_embeddings().weight.shape[0]),
        notes=[note] if (note := gated_deltanet_note(model, device)) else [],
    )
