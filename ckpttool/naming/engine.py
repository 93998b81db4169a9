"""Framework names -> transformers names: the engine that applies a family's table
(imported through `ckpttool.naming`, which serves its names on first use).

A family (naming/torchtitan.py, ...) is data: `Rule`s mapping a transformers name pattern to the
framework's, each with a transform. The engine matches every source key to one rule (or to the
family's `ignored` patterns: buffers transformers has no place for), and returns each
transformers key as `Piece`s: boxes of source tensors laid end to end in row-major order. Every
transform is such a list of boxes, so the planner turns a conversion into byte-range copies
(plan.consolidate.plan_pieces) and no whole tensor is ever held:

- RENAME: the source tensor as it is (one box);
- PERMUTE_Q / PERMUTE_K: the rows of each head reordered as transformers' rotary layout
  expects (torchtitan llama3 `_permute`: view(heads, head_dim / 2, 2, cols).transpose(1, 2)),
  two strided pieces per head (its even rows, then its odd ones: `Piece.step` 2), so one
  chunk per row of the view; heads from the config (num_attention_heads / num_key_value_heads);
- EXPERTS: grouped experts [E, ...] split on dim 0 into one key per expert (`{E}`);
- SPLIT_HALVES: rows split in two (Megatron's `linear_fc1` [gate; up] -> gate_proj, up_proj);
- EXPERTS_HALVES: both: grouped experts [E, 2F, D] (Megatron's SequentialMLP `linear_fc1`
  stacked on an experts axis), each expert's rows split into gate and up;
- SPLIT_QKV: rows un-interleaved per query group (Megatron's `linear_qkv`: each group's block
  is its q heads, then its k head, then its v head, `head_dim` rows each) into q, k, v.

A rule of a split names its targets in `hf` joined by "|", in order.

Placeholders: `{L}` a layer number, `{E}` an expert number, `{M}` an extra layer's number in the
source (DeepSeek's MTP layers), which the target numbers `{N}`: after the main layers. Pure:
names and shapes in, pieces out.

Example:
    >>> family = find_family(["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight", ...])
    >>> convert(family, shapes, settings)["model.layers.0.self_attn.q_proj.weight"].shape
    (64, 64)
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, raw_range_transforms
from ckpttool.core.errors import InvalidCheckpoint, UsageError
from ckpttool.core.geometry import Box, intersect, row_major_runs, slab_rows
from ckpttool.naming import pattern_regex as _regex, signature_matches

RENAME, PERMUTE_Q, PERMUTE_K, EXPERTS = "rename", "permute-q", "permute-k", "experts"
SPLIT_HALVES, SPLIT_QKV = "split-halves", "split-qkv"  # rows split into several targets (`hf` joined by "|")
EXPERTS_HALVES = "experts-split-halves"  # grouped experts [E, 2F, D], each split in two (gate|up)
_PLACEHOLDER = re.compile(r"\{([LE])\}")


@dataclass(frozen=True)
class Rule:
    """transformers' name `hf` <- the framework's name `source`, by `transform`."""

    hf: str
    source: str
    transform: str = RENAME


@dataclass(frozen=True)
class Family:
    """One framework's model family: how to recognise its checkpoints (`signature`: source
    patterns all present), the transformers architectures it converts to, its rules, the
    source patterns left out on purpose, and the key dropped when embeddings are tied."""

    name: str
    architectures: tuple[str, ...]
    signature: tuple[str, ...]
    rules: tuple[Rule, ...]
    ignored: tuple[str, ...] = ()
    tied_head: str | None = "lm_head.weight"  # the source key left out under tie_word_embeddings
    settings: tuple[str, ...] = ()  # config.json fields the transforms need
    _patterns: list = field(default_factory=list, compare=False, repr=False)  # compiled when first matched

    def match(self, key: str) -> tuple[Rule | None, dict[str, str]] | None:
        """Return (rule or None for an ignored key, its placeholders' values), or None."""
        if not self._patterns:  # compiled on first use: importing the tables compiles nothing (`inspect` startup)
            self._patterns[:] = [(rule, _regex(rule.source)) for rule in self.rules] + \
                [(None, _regex(pattern)) for pattern in self.ignored]  # whole at once: another thread sees all or none
        for rule, regex in self._patterns:
            found = regex.fullmatch(key)
            if found:
                return rule, found.groupdict()
        return None


@dataclass(frozen=True)
class Piece:
    """A box of a source tensor, written row-major into its place in a target tensor. With a
    `step` above 1 its rows are every `step`-th row of the source from the box's first one
    (the box's first size counts the rows taken): a rotary head's even or odd rows."""

    source: str
    box: Box
    step: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.box[1])


@dataclass(frozen=True)
class Target:
    """A transformers tensor made of `pieces` laid end to end, of `shape`."""

    key: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    rule: Rule


_LAYER_NUMBER = re.compile(r"^layers\.(\d+)\.")


def main_layer_count(keys: Iterable[str]) -> int:
    """Return how many main layers the source keys number (`layers.N.`): where `{N}` (an
    extra layer such as DeepSeek's MTP, `{M}` in the source) starts counting."""
    numbers = [int(found.group(1)) for key in keys if (found := _LAYER_NUMBER.match(key))]
    return max(numbers) + 1 if numbers else 0


def _target_name(pattern: str, values: Mapping[str, str], main_layers: int) -> str:
    """Return `pattern` with the matched placeholders filled in ({N}: extra layer M after the main ones)."""
    name = pattern.replace("{L}", values.get("L", ""))
    if "E" in values:  # experts stored one by one: the source names the expert
        name = name.replace("{E}", values["E"])
    if "M" in values:
        name = name.replace("{N}", str(int(values["M"]) + main_layers))
    return name


def find_family(keys: Iterable[str], families: Iterable[Family], config: Mapping[str, Any] | None = None,
                where: str = "") -> Family | None:
    """Return the family whose signature patterns all match some key (None: no framework's
    names, the keys are transformers' own), the one converting to the config's architecture
    when several frameworks' families share the names. InvalidCheckpoint (`config-mismatch`)
    when the config names an architecture the checkpoint's family does not convert to."""
    keys = list(keys)
    present = set(keys)
    candidates = [family for family in families if signature_matches(family.signature, keys, present)]
    if not candidates:
        return None
    architectures = (config or {}).get("architectures") or []
    if not architectures:  # families that share names (Megatron's): the first whose rules take every key
        if len(candidates) > 1:
            return next((family for family in candidates if all(family.match(key) for key in keys)), candidates[0])
        return candidates[0]
    for family in candidates:
        if any(name in family.architectures for name in architectures):
            return family
    names = sorted({name for family in candidates for name in family.architectures})
    raise InvalidCheckpoint(f"{where}: the weights are a {candidates[0].name} model, which converts to "
                            f"{' or '.join(names)}; the config names {architectures[0]} (wrong --assets?)",
                            code="config-mismatch")


def required_settings(family: Family, config: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """Return the config fields the family's transforms need; UsageError (exit 2) naming the
    missing ones and --assets when there is no config that has them."""
    config = config or {}
    missing = [name for name in family.settings if name not in config]
    if missing:
        raise UsageError(f"{where}: converting {family.name} to transformers names needs {', '.join(missing)} "
                         "from the model's config.json; pass --assets DIR with the transformers config.json")
    return {name: config[name] for name in family.settings}


def convert(family: Family, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], where: str,
            ) -> dict[str, Target]:
    """Return transformers key -> Target for source keys -> shapes, in source order (experts
    expanded in place). Raises InvalidCheckpoint (`config-mismatch`) naming a source key no rule
    takes, or one whose shape does not fit its transform."""
    tied = bool(config.get("tie_word_embeddings", False))
    main_layers = main_layer_count(shapes)
    targets: dict[str, Target] = {}
    for key, shape in shapes.items():
        found = family.match(key)
        if found is None:
            raise InvalidCheckpoint(f"{where}: {key} (shape {list(shape)}) has no transformers name in the "
                                    f"{family.name} table; export with --rename rules, or keep the framework's "
                                    "names with `ckpttool consolidate`", code="config-mismatch")
        rule, values = found
        if rule is None or (tied and key == family.tied_head):
            continue
        hf = _target_name(rule.hf, values, main_layers)
        for target in _apply(rule, hf, key, tuple(shape), config, where):
            if target.key in targets:
                raise InvalidCheckpoint(f"{where}: {target.key} is made from both {targets[target.key].pieces[0].source} "
                                        f"and {key}", code="config-mismatch")
            targets[target.key] = target
    return targets


def _apply(rule: Rule, hf: str, key: str, shape: tuple[int, ...], config: Mapping[str, Any],
           where: str) -> list[Target]:
    whole = ((0,) * len(shape), shape)
    if rule.transform == RENAME:
        return [Target(hf, shape, (Piece(key, whole),), rule)]
    if rule.transform == EXPERTS:
        if len(shape) < 2:
            raise InvalidCheckpoint(f"{where}: {key}: grouped experts need [experts, ...], not {list(shape)}",
                                    code="config-mismatch")
        inner = shape[1:]
        return [Target(hf.replace("{E}", str(expert)), inner,
                       (Piece(key, ((expert,) + (0,) * len(inner), (1,) + inner)),), rule)
                for expert in range(shape[0])]
    if rule.transform == EXPERTS_HALVES:
        names = hf.split("|")
        if len(shape) < 2 or shape[1] % 2 or len(names) != 2:
            raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} is not grouped experts of two halves",
                                    code="config-mismatch")
        half, rest = shape[1] // 2, tuple(shape[2:])
        return [Target(name.replace("{E}", str(expert)), (half, *rest),
                       (Piece(key, ((expert, part * half) + (0,) * len(rest), (1, half, *rest))),), rule)
                for expert in range(shape[0]) for part, name in enumerate(names)]
    if rule.transform == SPLIT_HALVES:
        names = hf.split("|")
        rows = shape[0] if shape else 0
        if len(names) != 2 or rows % 2:
            raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} does not split in two halves",
                                    code="config-mismatch")
        half = rows // 2
        return [Target(name, (half, *shape[1:]), (Piece(key, row_box(shape, part * half, half)),), rule)
                for part, name in enumerate(names)]
    if rule.transform == SPLIT_QKV:
        return _split_qkv(rule, hf, key, shape, config, where)
    if rule.transform in (PERMUTE_Q, PERMUTE_K):
        heads = _heads(rule, config)
        rows = shape[0] if shape else 0
        if len(shape) != 2 or heads <= 0 or rows % heads or (rows // heads) % 2:
            raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} does not split into {heads} heads of "
                                    "even size (the config's head counts disagree with the weights)",
                                    code="config-mismatch")
        head_dim = rows // heads  # output row (h, a, b) is source row (h, b, a): rotary_rows
        return [Target(hf, shape, tuple(Piece(key, ((h * head_dim + a, 0), (head_dim // 2, shape[1])), step=2)
                                        for h in range(heads) for a in range(2)), rule)]
    raise ValueError(f"unknown transform {rule.transform!r}")


def row_box(shape: tuple[int, ...], start: int, count: int) -> Box:
    """Return the box of rows [start, start + count) of dim 0 of a tensor of `shape`."""
    return ((start,) + (0,) * (len(shape) - 1), (count, *shape[1:]))


def _split_qkv(rule: Rule, hf: str, key: str, shape: tuple[int, ...], config: Mapping[str, Any],
               where: str) -> list[Target]:
    """Megatron's fused `linear_qkv` rows -> q, k, v (megatron-bridge QKVMapping): per query
    group, `heads / groups` q heads, then one k head, then one v head, `head_dim` rows each."""
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    rows = shape[0] if shape else 0
    head_dim = int(config.get("head_dim") or 0) or (rows // (heads + 2 * groups) if heads + 2 * groups else 0)
    names = hf.split("|")
    if len(names) != 3 or groups <= 0 or heads % groups or rows != (heads + 2 * groups) * head_dim or head_dim <= 0:
        raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} is not {heads} query heads and {groups} "
                                f"key/value groups of head_dim {head_dim} (the config's head counts disagree with the "
                                "weights)", code="config-mismatch")
    per_group = heads // groups
    block = (per_group + 2) * head_dim
    q = tuple(Piece(key, row_box(shape, g * block, per_group * head_dim)) for g in range(groups))
    k = tuple(Piece(key, row_box(shape, g * block + per_group * head_dim, head_dim)) for g in range(groups))
    v = tuple(Piece(key, row_box(shape, g * block + (per_group + 1) * head_dim, head_dim)) for g in range(groups))
    rest = tuple(shape[1:])
    return [Target(names[0], (heads * head_dim, *rest), q, rule), Target(names[1], (groups * head_dim, *rest), k, rule),
            Target(names[2], (groups * head_dim, *rest), v, rule)]


def _heads(rule: Rule, config: Mapping[str, Any]) -> int:
    heads = int(config["num_attention_heads"])
    if rule.transform == PERMUTE_K:
        return int(config.get("num_key_value_heads") or heads)
    return heads


def rotary_rows(rows: int, heads: int) -> list[int]:
    """Return, for each output row, the source row of torchtitan llama3's `_permute`
    (`w.view(heads, rows / heads / 2, 2, cols).transpose(1, 2).reshape(rows, cols)`): output
    row (h, a, b) is source row (h, b, a).

    Example:
        >>> rotary_rows(8, 2)
        [0, 2, 1, 3, 4, 6, 5, 7]
    """
    head_dim = rows // heads
    half = head_dim // 2
    return [h * head_dim + b * 2 + a for h in range(heads) for a in range(2) for b in range(half)]


def hf_names(family: Family, key: str, shape: tuple[int, ...], main_layers: int = 0) -> tuple[str, ...]:
    """Return the transformers names `key` becomes under `family` (none: left out or unknown);
    needs no config (what inspect shows). `main_layers`: `main_layer_count` of the source keys."""
    found = family.match(key)
    if found is None:
        return ()
    rule, values = found
    if rule is None:
        return ()
    hf = _target_name(rule.hf, values, main_layers)
    if rule.transform in (EXPERTS, EXPERTS_HALVES):
        return tuple(name.replace("{E}", str(expert)) for expert in range(shape[0] if shape else 0)
                     for name in hf.split("|"))
    return tuple(hf.split("|"))


def converted_checkpoint(checkpoint: Checkpoint, targets: Mapping[str, Target],
                         located: Mapping[str, Mapping[int, Any]], kept: Mapping[str, str] = MappingProxyType({})
                         ) -> Checkpoint:
    """Return `checkpoint` as transformers names it: a Checkpoint whose tensors are `targets`
    (their pieces naming source fqns), each chunk a raw byte range of a source chunk (no byte is
    read or copied here), plus the `kept` entries (key -> fqn: python objects) as they are. Every
    command reads it like any checkpoint: consolidate copies its ranges, diff compares them,
    `ckpttool.open` reads them. `located`: where each source chunk's raw bytes are
    (locating.locate_chunks); a chunk that must be decoded (zstd) is refused (UsageError)."""
    tensors: dict[str, Tensor] = {}
    sources: dict[str, _Source] = {}
    for key, target in targets.items():
        chunks: list[Chunk] = []
        row = 0
        for piece in target.pieces:
            source = sources.get(piece.source)
            if source is None:
                source = sources[piece.source] = _Source(checkpoint, piece.source, located[piece.source])
            chunks.extend(source.chunks(piece, row, target.shape, key))
            row += piece.box[1][len(piece.box[1]) - len(target.shape)] if target.shape else 1
        dtype = checkpoint.tensors[target.pieces[0].source].dtype
        tensors[key] = Tensor(key, dtype, target.shape, tuple(sorted(chunks, key=lambda c: c.offsets)))
    objects = {key: replace(checkpoint.objects[fqn], fqn=key) for key, fqn in kept.items() if fqn in checkpoint.objects}
    return replace(checkpoint, tensors=dict(sorted(tensors.items())), objects=dict(sorted(objects.items())),
                   nesting={}, orphan_blobs=(), model_prefix="")


class _Source:
    """A source tensor's distinct chunks and where their raw bytes are, looked up once for all
    the pieces cut from it. When its chunks are dim-0 slabs tiling it (FSDP's), a piece of
    whole rows is found by bisecting the slabs' first rows, one chunk per slab it meets (per
    row of a strided piece), without intersecting boxes."""

    def __init__(self, checkpoint: Checkpoint, fqn: str, located: Mapping[int, Any]):
        from ckpttool.plan import unique_chunks  # converting only: inspect names a family without it

        self.checkpoint, self.fqn, self.located = checkpoint, fqn, located
        self.tensor = tensor = checkpoint.tensors[fqn]
        self.indices = unique_chunks(tensor)
        boxes = [(tensor.chunks[index].offsets, tensor.chunks[index].sizes) for index in self.indices]
        slabs = [slab_rows(tensor.shape, box) for box in boxes]
        self.row_bytes = math.prod(tensor.shape[1:]) * tensor.itemsize if tensor.shape else 0
        self.slabs: list[tuple[int, int, int]] | None = None  # (first row, rows, chunk index), by first row
        whole = [slab for slab in slabs if slab is not None]
        if self.row_bytes and slabs and len(whole) == len(slabs):  # every chunk a dim-0 slab
            ordered = sorted((first, count, index) for (first, count), index in zip(whole, self.indices))
            starts = [first for first, _, _ in ordered]
            if starts == [0] + [first + count for first, count, _ in ordered[:-1]] and \
                    ordered[-1][0] + ordered[-1][1] == tensor.shape[0]:
                self.slabs, self.firsts = ordered, starts

    def chunks(self, piece: Piece, row: int, shape: tuple[int, ...], key: str) -> list[Chunk]:
        """Return the target chunks that hold `piece` (placed from target row `row` of a target of `shape`)."""
        rows = slab_rows(self.tensor.shape, piece.box) if len(piece.box[1]) == len(shape) else None
        if self.slabs is None or rows is None:
            if piece.step == 1:
                return self._chunks_of_box(piece.box, row, len(shape), key)
            return [chunk for number, box in enumerate(_strided_rows(piece))
                    for chunk in self._chunks_of_box(box, row + number, len(shape), key)]
        first, count = rows
        rest = self.tensor.shape[1:]
        zeros = (0,) * len(rest)
        row_bytes, step = self.row_bytes, piece.step
        found = []
        if step == 1:
            stop = first + count
            at = first
            while at < stop:
                slab_first, slab_stop, raw = self._slab(at, key)
                take = min(stop, slab_stop) - at
                blob = Blob(raw.file, raw.offset + (at - slab_first) * row_bytes, take * row_bytes, _RAW)
                found.append(Chunk((row + at - first, *zeros), (take, *rest), blob))
                at += take
            return found
        sizes = (1, *rest)
        slab_first = slab_stop = -1
        for number in range(count):
            at = first + number * step
            if not slab_first <= at < slab_stop:
                slab_first, slab_stop, raw = self._slab(at, key)
                file, offset = raw.file, raw.offset - slab_first * row_bytes
            found.append(Chunk((row + number, *zeros), sizes, Blob(file, offset + at * row_bytes, row_bytes, _RAW)))
        return found

    def _slab(self, at: int, key: str) -> tuple[int, int, Any]:
        """Return (first row, end row, raw bytes) of the slab holding source row `at`."""
        assert self.slabs is not None  # chunks bisects only a tensor tiled by slabs
        first, count, index = self.slabs[bisect.bisect_right(self.firsts, at) - 1]
        return first, first + count, self._raw(index, key)

    def _raw(self, index: int, key: str) -> Any:
        raw = self.located[index]
        if raw is None:
            chunk = self.tensor.chunks[index]
            raise UsageError(f"{self.checkpoint.path}: {self.fqn} chunk at {list(chunk.offsets)} must be decoded "
                             f"(a compressed blob) to make {key}; consolidate the checkpoint first, then export that")
        return raw

    def _chunks_of_box(self, box: Box, row: int, ndim: int, key: str) -> list[Chunk]:
        """Return the target chunks that hold the source `box` (placed from target row `row`):
        one per run of each source chunk it meets."""
        tensor = self.tensor
        drop = len(box[1]) - ndim  # leading dims of the source box that the target squeezes (an expert's index)
        chunks = []
        for index in self.indices:
            chunk = tensor.chunks[index]
            region = intersect(box, (chunk.offsets, chunk.sizes))
            if region is None or not math.prod(region[1]):
                continue
            raw = self._raw(index, key)
            for start, length, sub in _region_runs((chunk.offsets, chunk.sizes), region, tensor.itemsize):
                offsets = (row + sub[0][drop] - box[0][drop], *sub[0][drop + 1:]) if ndim else ()
                sizes = tuple(sub[1][drop:])
                chunks.append(Chunk(offsets, sizes, Blob(raw.file, raw.offset + start, length, _RAW)))
        return chunks


_RAW = raw_range_transforms()


def _strided_rows(piece: Piece) -> list[Box]:
    """Return the one-row boxes of a strided piece, in its order."""
    (first, *others), (count, *sizes) = piece.box
    return [((first + number * piece.step, *others), (1, *sizes)) for number in range(count)]


def _region_runs(box: Box, region: Box, itemsize: int) -> list[tuple[int, int, Box]]:
    """Return (byte offset in the chunk, length, sub-region) that make up `region` of a chunk:
    the region whole when its bytes are contiguous in the chunk, else one sub-region per run
    (split on its first dimension, recursively)."""
    runs = row_major_runs(box, region, itemsize)
    if len(runs) == 1:
        return [(runs[0][0], runs[0][1], region)]
    offsets, sizes = region
    first = next(d for d, size in enumerate(sizes) if size > 1)
    found = []
    for step in range(sizes[first]):
        sub = ((*offsets[:first], offsets[first] + step, *offsets[first + 1:]), (*sizes[:first], 1, *sizes[first + 1:]))
        found.extend(_region_runs(box, sub, itemsize))
    return found
