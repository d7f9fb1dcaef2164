"""Which teacher layers a cache taps, and which of them a drafter can be served with.

A tapped hidden state is the output of a 0-based decoder layer, before the model's final norm
(docs/design.md, "What a cache position means"). The default spread, the rule that refuses the
last layer (the one owner of it: the build refuses it when it resolves the layers, training
refuses an older cache holding it) and the resolution of a teacher config's layers live here.
"""

from __future__ import annotations

from dflash_common.errors import ConfigError
from dflash_teacher.settings.teacher_config import TeacherConfig


def default_layer_ids(num_teacher_layers: int, num_tapped_layers: int = 5) -> list[int]:
    """The default tapped layers: spread over 1..L-3, or the middle layer for one.

    Never layer 0 nor the last layer (see `check_servable_layers`). Teachers too shallow for that
    spread (tiny test models) get distinct layers spread over 1..L-2 instead, at most one per layer.
    """
    if num_teacher_layers < 3:
        raise ConfigError(
            f"a {num_teacher_layers}-layer teacher has no layer between its first and its last to tap by "
            "default; pass --layers 0 (the last layer cannot be served)")
    if num_tapped_layers == 1:
        return [num_teacher_layers // 2]
    step = (num_teacher_layers - 4) / (num_tapped_layers - 1)
    layers = [round(1 + i * step) for i in range(num_tapped_layers)]
    if len(set(layers)) == len(layers) and min(layers) >= 1:
        return layers
    n = min(num_tapped_layers, num_teacher_layers - 2)
    return sorted({round(1 + i * (num_teacher_layers - 3) / max(n - 1, 1)) for i in range(n)})


def check_servable_layers(layer_ids: list[int] | tuple[int, ...], num_teacher_layers: int, what: str,
                          fix: str = "use layers in {allowed}") -> None:
    """Refuse tapped layers a serving engine cannot give the drafter.

    vLLM and SGLang capture a layer's output as the input of the next layer, so the last decoder
    layer's output is never captured; the reference decoders read transformers' `hidden_states[L]`,
    which is after the final norm, while a cache stores layer outputs before it.
    """
    last = num_teacher_layers - 1
    if last in layer_ids:
        raise ConfigError(
            f"{what} {','.join(map(str, layer_ids))}: layer {last} is the teacher's last decoder layer, which "
            "vLLM and SGLang cannot serve (they capture a layer's output as the next layer's input); "
            + fix.format(allowed=f"0..{last - 1}"))


def resolve_layers(cfg: TeacherConfig, num_layers: int, exact_count: bool = False) -> list[int]:
    """The tapped layers; `exact_count` (a build) refuses a default spread shorter than asked."""
    layers = list(cfg.layers) if cfg.layers is not None else default_layer_ids(num_layers, cfg.num_tapped_layers)
    if exact_count and cfg.layers is None and len(layers) < cfg.num_tapped_layers:
        raise ConfigError(f"--tapped-layers {cfg.num_tapped_layers} asks for more tapped layers than a {num_layers}-layer "
                          f"teacher has between its first and last (layers 1..{num_layers - 2}); use --tapped-layers "
                          f"{len(layers)} or list them with --layers")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"--layers {','.join(map(str, layers))}: layers {bad} do not exist in a {num_layers}-layer teacher (use 0..{num_layers - 1})")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"--layers lists a layer twice: {layers}")
    check_servable_layers(layers, num_layers, "--layers")
    return layers
