"""Input distribution: every rank's local KJT becomes, on each rank, a KJT of the global
batch for the shards that rank holds.

On the host, each feature's bags are routed to the ranks of its table's shards
(row-sharded tables: each id to the shard that owns it, renumbered to its local
id, with its gain — weight x the combiner's scale over the whole bag — as its
weight, since the shard sees only part of the bag). One all_to_all carries the
counts, one the lengths and ids, one the weights (when there are any). A
receiver lays the sources' samples end to end: its batch is the global batch,
rank 0's samples first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from sparsecore.distributed.layout import RowBuckets, ShardLayout
from sparsecore.errors import InputError


def _bag_gains(lengths: torch.Tensor, weights: torch.Tensor | None, combiner: str, num_values: int) -> torch.Tensor:
    """Weight x combiner scale of every id, over whole bags."""
    w = weights if weights is not None else torch.ones(num_values)
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    if combiner == "mean":
        scale = 1.0 / lengths.clamp(min=1).float()
    elif combiner == "sqrtn":
        sq = torch.zeros(lengths.numel(), dtype=torch.float64).index_add_(0, bag, w.double() ** 2)
        scale = torch.where(sq > 0, sq.rsqrt(), torch.zeros_like(sq)).float()
    else:
        return w
    return w * scale[bag]


def _row_splits(rows: RowBuckets, features: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                ) -> list[list[tuple]]:
    """Per feature (values, lengths, gains), per shard of the mod sharding ``rows``: its
    (lengths, local ids, gains). The features (of one batch size) go through in one pass:
    owners, local ids and per-shard lengths of all their ids at once."""
    values = torch.cat([v for v, _, _ in features])
    lengths = torch.stack([l for _, l, _ in features])  # (features, bags)
    gains = None if features[0][2] is None else torch.cat([g for _, _, g in features])
    owner, local = rows.shard_of(values), rows.local_ids(values)
    bags = lengths.numel()
    bag = torch.repeat_interleave(torch.arange(bags), lengths.reshape(-1))
    kept_lengths = torch.bincount(owner * bags + bag, minlength=rows.shards * bags).view(rows.shards, *lengths.shape)
    out: list[list[tuple]] = [[] for _ in features]
    for shard in range(rows.shards):
        keep = owner == shard  # ids stay in order: feature by feature, bag by bag
        counts = kept_lengths[shard].sum(1).tolist()
        ids = local[keep].split(counts)
        kept_gains = gains[keep].split(counts) if gains is not None else [None] * len(features)
        for f in range(len(features)):
            out[f].append((kept_lengths[shard, f], ids[f], kept_gains[f]))
    return out


def jagged_dict(kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    """``kjt.to_dict()``, also for a batch of no samples (TorchRec's fails at stride 0)."""
    if kjt.stride() != 0:
        return kjt.to_dict()
    weights = kjt.weights_or_none()
    return {f: JaggedTensor(values=kjt.values()[:0], lengths=kjt.lengths()[:0],
                            weights=None if weights is None else weights[:0]) for f in kjt.keys()}


def select(kjt: KeyedJaggedTensor, features: dict[str, str]) -> KeyedJaggedTensor:
    """The KJT of ``features`` (new name -> feature of ``kjt``), in that order; keeps a stride of 0."""
    if kjt.stride() != 0:
        jagged = kjt.to_dict()
        return KeyedJaggedTensor.from_jt_dict({new: jagged[old] for new, old in features.items()})
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=list(features), values=kjt.values()[:0], lengths=kjt.lengths()[:0],
                             weights=None if weights is None else weights[:0], stride=0)


class InputDist:
    """Routes local KJTs to the ranks' shards (see the module docstring)."""

    def __init__(self, layout: ShardLayout, rank: int, group: dist.ProcessGroup | None, weighted: bool = True):
        """``weighted``: the collection's ``is_weighted``; False ignores the batches' weights
        (the shards' engines take weights always: the routed gains travel as weights)."""
        self.layout, self.rank, self.group = layout, rank, group
        self.weighted = weighted
        self.world = layout.world_size
        self.routes = layout.routes()
        self.replicated = {f for c in layout.replicated for f in c.feature_names}  # not routed: local only
        self.combiners = {f: c.combiner_name for c in layout.configs for f in c.feature_names}
        self.row_sharded = {f for c in layout.configs for f in c.feature_names
                            if any(s.rows is not None for s in layout.shards.get(c.name, ()))}
        self.local_features = layout.local_features(rank)
        # Weights travel when the batch has them or a row-sharded bag needs its gains.
        self.gains_needed = any(self.combiners[f] in ("mean", "sqrtn") for f in self.row_sharded)
        self.bytes_sent = 0
        """Bytes this rank sent to other ranks in all calls (counts, lengths, ids, weights)."""

    def __call__(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, list[int]]:
        """The global batch of this rank's shards, and every rank's batch size (rank order)."""
        if not self.weighted and kjt.weights_or_none() is not None:
            kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), stride=kjt.stride())
        if self.world == 1 and not self.row_sharded and self.local_features:
            # One rank, whole bags: the batch is already the engine's, up to key names.
            return self._rename(kjt), [kjt.stride()]
        per_rank = self._route(kjt)
        return self._exchange(per_rank, kjt.stride(), kjt.weights_or_none() is not None or self.gains_needed)

    def _route(self, kjt: KeyedJaggedTensor) -> list[dict[str, tuple]]:
        keys = kjt.keys()
        known = set(self.routes) | self.replicated
        unknown = sorted(set(keys) - known)
        missing = sorted(known - set(keys))
        if unknown or missing:
            raise InputError(f"the batch's features do not match the tables: unknown {unknown}, missing {missing}")
        weighted = kjt.weights_or_none() is not None or self.gains_needed
        per_rank: list[dict[str, tuple]] = [{} for _ in range(self.world)]
        by_rows: dict[RowBuckets, list[tuple[str, tuple]]] = {}  # features split over several shards
        for feature, jagged in jagged_dict(kjt).items():
            if feature in self.replicated:
                continue
            values, lengths = jagged.values().cpu().long(), jagged.lengths().cpu().long()
            weights = jagged.weights_or_none()
            weights = None if weights is None else weights.cpu().float()
            gains = None
            if weighted:
                combiner = self.combiners[feature] if feature in self.row_sharded else "sum"
                gains = _bag_gains(lengths, weights, combiner, values.numel())
            rows = self.routes[feature][0].rows
            if rows is not None and rows.shards > 1:
                by_rows.setdefault(rows, []).append((feature, (values, lengths, gains)))
                continue
            # Whole bags (a one-shard table's ids are already its local ids): to every route.
            for route in self.routes[feature]:
                per_rank[route.rank][route.local_feature] = (lengths, values, gains)
        for rows, features in by_rows.items():
            for (feature, _), per_shard in zip(features, _row_splits(rows, [f for _, f in features])):
                for route in self.routes[feature]:
                    per_rank[route.rank][route.local_feature] = per_shard[route.shard]
        return per_rank

    def _rename(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        local = {route.local_feature: f for f, routes in self.routes.items() for route in routes}
        return select(kjt, {f: local[f] for f in self.local_features})

    def _exchange(self, per_rank: list[dict[str, tuple]], batch_size: int,
                  weighted: bool) -> tuple[KeyedJaggedTensor, list[int]]:
        sends, weight_sends, counts = [], [], []
        for rank in range(self.world):
            parts = [per_rank[rank][f] for f in self.layout.local_features(rank)]
            lengths = [p[0] for p in parts]
            values = [p[1] for p in parts]
            sends.append(torch.cat(lengths + values) if parts else torch.zeros(0, dtype=torch.int64))
            if weighted:
                weight_sends.append(torch.cat([p[2] for p in parts]) if parts else torch.zeros(0))
            counts.append([batch_size, sum(v.numel() for v in values)])
        others = [r for r in range(self.world) if r != self.rank]
        self.bytes_sent += sum(sends[r].numel() * 8 + 16 + (weight_sends[r].numel() * 4 if weighted else 0)
                               for r in others)
        received = torch.empty(self.world, 2, dtype=torch.int64)
        dist.all_to_all_single(received, torch.tensor(counts, dtype=torch.int64), group=self.group)
        sizes = received.tolist()  # per source: (its batch size, ids it sends here)
        num_local = len(self.local_features)
        payload_sizes = [num_local * b + n for b, n in sizes]
        payload = torch.empty(sum(payload_sizes), dtype=torch.int64)
        dist.all_to_all_single(payload, torch.cat(sends), output_split_sizes=payload_sizes,
                               input_split_sizes=[s.numel() for s in sends], group=self.group)
        weights = None
        if weighted:
            weights = torch.empty(sum(n for _, n in sizes))
            dist.all_to_all_single(weights, torch.cat(weight_sends), output_split_sizes=[n for _, n in sizes],
                                   input_split_sizes=[w.numel() for w in weight_sends], group=self.group)
        kjt = self._assemble(payload.split(payload_sizes),
                             None if weights is None else weights.split([n for _, n in sizes]), sizes)
        return kjt, [b for b, _ in sizes]

    def _assemble(self, payloads, weights, sizes) -> KeyedJaggedTensor:
        """Per local feature, the sources' bags end to end (rank order)."""
        num_local = len(self.local_features)
        lengths_by_feature = [[] for _ in range(num_local)]
        values_by_feature = [[] for _ in range(num_local)]
        weights_by_feature = [[] for _ in range(num_local)]
        for source, (batch, _) in enumerate(sizes):
            lengths = payloads[source][:num_local * batch].view(num_local, batch)
            per_feature = lengths.sum(1).tolist()
            values = payloads[source][num_local * batch:].split(per_feature)
            w = weights[source].split(per_feature) if weights is not None else None
            for j in range(num_local):
                lengths_by_feature[j].append(lengths[j])
                values_by_feature[j].append(values[j])
                if w is not None:
                    weights_by_feature[j].append(w[j])
        cat = lambda parts, dtype: torch.cat([x for p in parts for x in p]) if parts else torch.zeros(0, dtype=dtype)  # noqa: E731
        return KeyedJaggedTensor(
            keys=list(self.local_features),
            values=cat(values_by_feature, torch.int64),
            lengths=cat(lengths_by_feature, torch.int64),
            weights=cat(weights_by_feature, torch.float32) if weights is not None else None,
            stride=sum(b for b, _ in sizes),
        )
