"""SGLang's KVArgs -> pdkv ``BufferLayout``: which registered regions one rank holds.

Owns: ``layout_from_kv_args`` and the table of SGLang state types pdkv can move (``state_kind_for``).
Must not import SGLang, torch or anything that does I/O: it reads plain attributes (or keys of a mapping),
so tests feed it recorded KVArgs without SGLang installed. Anything it cannot describe faithfully is a
``ConfigError`` naming the field and the values, never a guess.

How SGLang lays out KVArgs (0.5.23):

- ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``: one entry per buffer, one item = one page of that
  buffer. The last ``num_draft_entries`` entries are the draft model's, the rest the target's.
- MLA: each entry is one layer's latent KV. MHA: per model, the first half of the entries are K buffers and
  the second half V buffers, layer by layer in the same order.
- Layer ids: ``kv_layer_ids[i]`` when the list is non-empty (hybrid pools; it covers draft entries too),
  otherwise ``prefill_start_layer + j`` for the target's j-th layer and ``j`` for the draft's.
- ``aux_*``: one AUX buffer per entry, one item = one request's metadata row; its layer id is its index.
- ``state_types`` with per type ``state_data_ptrs/_lens/_item_lens/_layer_ids``: SWA pages become
  ``BufferKind.SWA`` buffers, DSA/NSA index pages (index K and its scale packed in one item) become
  ``BufferKind.INDEX_K`` buffers with the packed item size. Layer id: ``state_layer_ids`` when given for
  every entry, else the entry's index in its component.
- Draft-model state (the draft's NSA/DSA index buffers registered beside the target's, MTP):
  ``draft_state_buffer_start`` / ``draft_state_buffer_count`` say which entries of a state component
  are the draft model's: ints for the DSA/NSA component (where SGLang appends the draft pool's
  ``get_state_buf_infos()``), or one value per ``state_types`` entry (None: no draft entries there).
  Those entries become ``ModelRole.DRAFT`` buffers, numbered from 0 like draft KV layers unless
  ``state_layer_ids`` names them. Without the fields every state entry is the target's (SGLang 0.5.23
  sets neither: its appended draft entries then read as more target layers, and a decode without
  them is refused as another target model, never guessed apart). A pair of ranks whose draft state
  differs is then served as the layout policy says (``pdkv.mapping.layout_policy``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, TypeAlias

from pdkv.errors import ConfigError
from pdkv.mapping import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole

KVArgsLike: TypeAlias = object
"""SGLang's ``KVArgs`` (an attribute bag), any object with the same attributes, or a mapping of them."""

_STATE_KINDS: Final[Mapping[str, BufferKind]] = {
    "swa": BufferKind.SWA,
    "dsa": BufferKind.INDEX_K,
}

SUPPORTED_STATE_TYPES: Final[frozenset[str]] = frozenset(_STATE_KINDS)
"""The values of SGLang's ``StateType`` that pdkv can move (SWA pages and DSA/NSA index pages)."""

_MISSING: Final = object()


def state_kind_for(state_type: object) -> BufferKind:
    """The pdkv buffer kind of one SGLang state type (its enum member or its string value).

    Every other type (Mamba, QSA, DSA tail, MiniMax, SWA ring, DeepSeek-V4 request state, request rows,
    block scales) is refused: pdkv has no buffer kind that keeps their addressing.
    """
    value = getattr(state_type, "value", state_type)
    kind = _STATE_KINDS.get(value) if isinstance(value, str) else None
    if kind is None:
        raise ConfigError(
            f"SGLang state type {value!r} is not supported by pdkv (supported: "
            f"{sorted(SUPPORTED_STATE_TYPES)}); use another transfer backend for this model"
        )
    return kind


def layout_from_kv_args(kv_args: KVArgsLike, is_mla: bool) -> BufferLayout:
    """Describe one SGLang rank's KV, state and aux buffers as a pdkv ``BufferLayout``.

    ``is_mla`` is SGLang's ``is_mla_backend``: MLA entries are one buffer per layer, MHA entries are K
    halves then V halves per model.
    """
    page_size = _int(kv_args, "page_size")
    ptrs = _ints(kv_args, "kv_data_ptrs")
    lens = _ints(kv_args, "kv_data_lens")
    items = _ints(kv_args, "kv_item_lens")
    _same_length("kv_data_ptrs", ptrs, kv_data_lens=lens, kv_item_lens=items)
    if not ptrs:
        raise ConfigError("KVArgs.kv_data_ptrs is empty: a rank with no KV buffer cannot transfer anything")
    num_draft = _int(kv_args, "num_draft_entries", default=0)
    if not 0 <= num_draft < len(ptrs):
        raise ConfigError(
            f"KVArgs.num_draft_entries is {num_draft} for {len(ptrs)} KV entries: the target model must "
            "keep at least one entry"
        )
    compression = _get(kv_args, "mla_compression_ratios", None)
    if compression is not None:
        raise ConfigError(
            "KVArgs.mla_compression_ratios is set (compressed-MLA pool, e.g. DeepSeek-V4): its buffers are "
            "grouped by compression ratio, not by layer, and pdkv does not support that layout"
        )
    layer_ids = _ints(kv_args, "kv_layer_ids", default=())
    if layer_ids and len(layer_ids) != len(ptrs):
        raise ConfigError(
            f"KVArgs.kv_layer_ids has {len(layer_ids)} ids for {len(ptrs)} KV entries (it must cover every "
            f"entry, draft included): ids {_summary(layer_ids)}"
        )
    start_layer = _int(kv_args, "prefill_start_layer", default=0)

    num_target = len(ptrs) - num_draft
    specs: list[BufferSpec] = []
    for model, first, count, base_layer in (
        (ModelRole.TARGET, 0, num_target, start_layer),
        (ModelRole.DRAFT, num_target, num_draft, 0),
    ):
        if count == 0:
            continue
        entries = range(first, first + count)
        if not is_mla and count % 2:
            raise ConfigError(
                f"MHA {model.value} model has {count} KV entries: SGLang lists K buffers then V buffers, "
                "so the count must be even"
            )
        per_kind = count if is_mla else count // 2
        positional = [base_layer + j for j in range(per_kind)]
        ids = [layer_ids[i] for i in entries] if layer_ids else positional * (count // per_kind)
        if is_mla:
            kinds = [BufferKind.KV] * count
        else:
            if ids[:per_kind] != ids[per_kind:]:
                raise ConfigError(
                    f"MHA {model.value} K and V layer ids differ: {_summary(ids[:per_kind])} vs "
                    f"{_summary(ids[per_kind:])}"
                )
            kinds = [BufferKind.K] * per_kind + [BufferKind.V] * per_kind
        for kind, layer, i in zip(kinds, ids, entries, strict=True):
            specs.append(_spec(kind, model, layer, ptrs[i], lens[i], items[i], f"kv entry {i}"))

    aux_ptrs = _ints(kv_args, "aux_data_ptrs", default=())
    aux_lens = _ints(kv_args, "aux_data_lens", default=())
    aux_items = _ints(kv_args, "aux_item_lens", default=())
    _same_length("aux_data_ptrs", aux_ptrs, aux_data_lens=aux_lens, aux_item_lens=aux_items)
    for i in range(len(aux_ptrs)):
        specs.append(
            _spec(BufferKind.AUX, ModelRole.TARGET, i, aux_ptrs[i], aux_lens[i], aux_items[i], f"aux {i}")
        )

    specs.extend(_state_specs(kv_args))
    try:
        return BufferLayout.build(
            attention=AttentionKind.MLA if is_mla else AttentionKind.MHA, page_size=page_size, buffers=specs
        )
    except ValueError as exc:
        raise ConfigError(f"KVArgs do not describe a valid pdkv layout: {exc}") from exc


def _draft_ranges(kv_args: KVArgsLike, types: Sequence[object], sizes: Sequence[int]) -> list[range]:
    """Per state component, the entries that are the draft model's (``draft_state_buffer_start/count``)."""
    start = _get(kv_args, "draft_state_buffer_start", None)
    count = _get(kv_args, "draft_state_buffer_count", None)
    if start is None and count is None:
        return [range(0) for _ in types]
    if start is None or count is None:
        raise ConfigError(
            "KVArgs.draft_state_buffer_start and draft_state_buffer_count come together: got "
            f"start={start!r}, count={count!r}"
        )
    if isinstance(start, int) and not isinstance(start, bool):
        dsa = [t for t, st in enumerate(types) if getattr(st, "value", st) == "dsa"]
        if len(dsa) != 1:
            raise ConfigError(
                "KVArgs.draft_state_buffer_start/count are single ints, which name the DSA/NSA state "
                f"component, but state_types has {len(dsa)} of them: give one value per state type"
            )
        starts: list[object] = [None] * len(types)
        counts: list[object] = [None] * len(types)
        starts[dsa[0]], counts[dsa[0]] = start, count
    else:
        starts = _list(kv_args, "draft_state_buffer_start")
        counts = _list(kv_args, "draft_state_buffer_count")
        if len(starts) != len(types) or len(counts) != len(types):
            raise ConfigError(
                f"KVArgs.draft_state_buffer_start/count have {len(starts)}/{len(counts)} values for "
                f"{len(types)} state types"
            )
    ranges: list[range] = []
    for t, (first, n) in enumerate(zip(starts, counts, strict=True)):
        if first is None and n is None:
            ranges.append(range(0))
            continue
        if (
            not isinstance(first, int)
            or not isinstance(n, int)
            or isinstance(first, bool)
            or isinstance(n, bool)
            or first < 0
            or n < 0
            or first + n > sizes[t]
        ):
            raise ConfigError(
                f"KVArgs.draft_state_buffer_start/count of state type {t} ({first!r}, {n!r}) do not name "
                f"entries of its {sizes[t]} buffers"
            )
        ranges.append(range(first, first + n))
    return ranges


def _state_specs(kv_args: KVArgsLike) -> list[BufferSpec]:
    types = _list(kv_args, "state_types", default=())
    if not types:
        return []
    ptrs = _nested(kv_args, "state_data_ptrs", len(types))
    lens = _nested(kv_args, "state_data_lens", len(types))
    items = _nested(kv_args, "state_item_lens", len(types))
    given_ids = _nested(kv_args, "state_layer_ids", len(types), optional=True)
    drafts = _draft_ranges(kv_args, types, [len(p) for p in ptrs])
    seen: dict[BufferKind, str] = {}
    specs: list[BufferSpec] = []
    for t, state_type in enumerate(types):
        kind = state_kind_for(state_type)
        name = str(getattr(state_type, "value", state_type))
        if kind in seen:
            raise ConfigError(
                f"KVArgs.state_types lists {seen[kind]!r} and {name!r}, which both map to pdkv's "
                f"{kind.value} state: one component per kind is supported"
            )
        seen[kind] = name
        _same_length(f"state_data_ptrs[{t}]", ptrs[t], state_data_lens=lens[t], state_item_lens=items[t])
        draft = drafts[t]
        positional = [i - draft.start if i in draft else i for i in range(len(ptrs[t]))]
        ids = list(given_ids[t]) if given_ids and given_ids[t] else positional
        if len(ids) != len(ptrs[t]):
            raise ConfigError(
                f"KVArgs.state_layer_ids[{t}] ({name}) has {len(ids)} ids for {len(ptrs[t])} buffers: "
                f"{_summary(ids)}"
            )
        for i in range(len(ptrs[t])):
            model = ModelRole.DRAFT if i in draft else ModelRole.TARGET
            specs.append(_spec(kind, model, ids[i], ptrs[t][i], lens[t][i], items[t][i], f"{name} {i}"))
    return specs


def _spec(
    kind: BufferKind, model: ModelRole, layer: int, ptr: int, length: int, item: int, what: str
) -> BufferSpec:
    try:
        return BufferSpec(
            kind=kind, model=model, layer_id=layer, base_ptr=ptr, length=length, item_bytes=item
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"KVArgs {what} ({model.value} {kind.value} layer {layer}): {exc}") from exc


def _get(kv_args: KVArgsLike, name: str, default: object = _MISSING) -> object:
    value = kv_args.get(name, default) if isinstance(kv_args, Mapping) else getattr(kv_args, name, default)
    if value is _MISSING:
        raise ConfigError(f"KVArgs.{name} is not set")
    return value


def _int(kv_args: KVArgsLike, name: str, default: int | None = None) -> int:
    value = _get(kv_args, name) if default is None else _get(kv_args, name, default)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"KVArgs.{name} must be an int, got {value!r}")
    return value


def _list(kv_args: KVArgsLike, name: str, default: Sequence[object] | None = None) -> list[object]:
    value = _get(kv_args, name) if default is None else _get(kv_args, name, default)
    if value is None and default is not None:
        return list(default)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(f"KVArgs.{name} must be a list, got {type(value).__name__}")
    return list(value)


def _ints(kv_args: KVArgsLike, name: str, default: Sequence[int] | None = None) -> list[int]:
    return _as_ints(_list(kv_args, name, default), f"KVArgs.{name}")


def _as_ints(values: Sequence[object], what: str) -> list[int]:
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{what} must hold ints, got {v!r}")
        out.append(v)
    return out


def _nested(kv_args: KVArgsLike, name: str, count: int, *, optional: bool = False) -> list[list[int]]:
    outer = _list(kv_args, name, () if optional else None)
    if optional and not outer:
        return []
    if len(outer) != count:
        raise ConfigError(f"KVArgs.{name} has {len(outer)} components for {count} state types")
    result: list[list[int]] = []
    for t, inner in enumerate(outer):
        if isinstance(inner, str | bytes) or not isinstance(inner, Sequence):
            raise ConfigError(f"KVArgs.{name}[{t}] must be a list, got {type(inner).__name__}")
        result.append(_as_ints(inner, f"KVArgs.{name}[{t}]"))
    return result


def _same_length(first: str, values: Sequence[int], **others: Sequence[int]) -> None:
    for name, other in others.items():
        if len(other) != len(values):
            raise ConfigError(f"KVArgs.{first} has {len(values)} entries but {name} has {len(other)}")


def _summary(ids: Sequence[int]) -> str:
    if len(ids) <= 8:
        return str(list(ids))
    return f"[{', '.join(map(str, ids[:4]))}, ..., {', '.join(map(str, ids[-2:]))}] ({len(ids)} ids)"
