"""Diffusers tensor names -> the original repo's (what ComfyUI loads), without reading a weight.

Each original tensor is a list of row ranges of diffusers tensors (`Piece`s): a rename is one
whole piece, a fusion (Flux `img_attn.qkv` = to_q | to_k | to_v) several, a swap (the final
AdaLayerNorm: original (shift, scale), diffusers (scale, shift)) the two halves of one tensor in
the other order. Rows are contiguous bytes in a safetensors file, so the writer streams every
piece straight from the source shards: nothing is concatenated in memory. The rules are data in
families.py; tests/test_diffusion.py checks them against diffusers' own single-file converters
(original -> diffusers), which must give back every diffusers tensor bit for bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import QuantizationError
from .families import Family


@dataclass(frozen=True)
class Piece:
    key: str  # the source tensor
    row0: int
    row1: int


@dataclass(frozen=True)
class Original:
    """One tensor of the original layout: its name, shape, and where its rows come from."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.key for p in self.pieces))


def _rename(family: Family, key: str) -> str:
    for pattern, repl in family.renames:
        key = re.sub(pattern, repl, key, count=1)
    return key


def _swapped(family: Family, shapes: dict[str, tuple]) -> set[str]:
    """Original keys whose halves swap; `@last:<x>` names <x> of the last joint block (SD3)."""
    out = set()
    for s in family.swaps:
        if s.startswith("@last:"):
            blocks = [int(m.group(1)) for k in shapes if (m := re.match(r"^transformer_blocks\.(\d+)\.", k))]
            if blocks:
                out |= {f"joint_blocks.{max(blocks)}.{s[len('@last:') :]}.{leaf}" for leaf in ("weight", "bias")}
        else:
            out.add(s)
    return out


def to_original(family: Family, shapes: dict[str, tuple[int, ...]]) -> list[Original]:
    """Every diffusers tensor (name -> shape) placed in the original layout, in source order.

    Raises:
        QuantizationError: a fused group misses a member or its members disagree in width, or
            two tensors would get one original name (the rules do not fit this model).
    """
    groups: dict[tuple[str, str], dict[str, str]] = {}  # (original module, leaf) -> member -> key
    order: list = []  # original names in the order of their first source tensor
    singles: dict[str, Original] = {}
    swaps = _swapped(family, shapes)
    for key, shape in shapes.items():
        mod, _, leaf = key.rpartition(".")
        for fu in family.fusions:
            m = re.match(fu.match, mod)
            if m and leaf in ("weight", "bias"):
                target = m.expand(fu.target)
                members = groups.setdefault((target, leaf), {})
                if not members:
                    order.append((target, leaf))
                members[m.group("m")] = key
                break
        else:
            name = _rename(family, key)
            if name in singles:
                raise QuantizationError(
                    f"{key} and {singles[name].pieces[0].key} both map to {name} in the {family.label} layout",
                    "this model does not fit the family's key map; convert with `format=diffusers`",
                )
            n = shape[0] if shape else 0
            if name in swaps and shape and n % 2 == 0:
                pieces = (Piece(key, n // 2, n), Piece(key, 0, n // 2))
            else:
                pieces = (Piece(key, 0, n),)
            singles[name] = Original(name, tuple(shape), pieces)
            order.append(name)
    out = []
    for item in order:
        if isinstance(item, str):
            out.append(singles[item])
            continue
        (target, leaf), members = item, groups[item]
        fu = next(f for f in family.fusions if set(members) <= set(f.members))
        missing = [m for m in fu.members if m not in members]
        if missing:
            raise QuantizationError(
                f"{target}.{leaf} fuses {', '.join(fu.members)} but {', '.join(missing)} is missing",
                "the checkpoint is incomplete, or not this family's layout",
            )
        keys = [members[m] for m in fu.members]
        tails = {tuple(shapes[k][1:]) for k in keys}
        if len(tails) != 1:
            raise QuantizationError(
                f"{target}.{leaf}: its parts {', '.join(keys)} differ in width", "the checkpoint is corrupt"
            )
        rows = sum(shapes[k][0] for k in keys)
        name = f"{target}.{leaf}"
        if name in singles:
            raise QuantizationError(
                f"{name} is both stored and fused from {', '.join(keys)}", "the checkpoint is corrupt"
            )
        out.append(Original(name, (rows, *tails.pop()), tuple(Piece(k, 0, shapes[k][0]) for k in keys)))
    return out


def identity(shapes: dict[str, tuple[int, ...]]) -> list[Original]:
    """An original-layout source (a single file) as it is: one whole piece per tensor."""
    return [Original(k, tuple(s), (Piece(k, 0, s[0] if s else 0),)) for k, s in shapes.items()]
