"""Fused optimizers: several steps with repeated ids against their references."""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

from sparsecore import SparseCoreEmbeddingConfig, optim
from sparsecore.errors import ConfigError
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import random_kjt

TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=23, embedding_dim=8, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="b", num_embeddings=11, embedding_dim=8, feature_names=["f2"], pooling=PoolingType.MEAN),
]
STEPS = 4


def targets(batch, width, step):
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(100 + step))


def train_engine(optimizer, tables=TABLES, batch=6, num_sparsecores=4, max_ids_per_partition=None, **kw):
    reference = EmbeddingBagCollection(tables=tables, **kw)
    engine_tables = tables if max_ids_per_partition is None else [
        SparseCoreEmbeddingConfig(config=t, max_ids_per_partition=max_ids_per_partition,
                                  max_unique_ids_per_partition=max_ids_per_partition) for t in tables]
    engine = SparseCoreEmbeddingBagCollection(engine_tables, optimizer, device="tpu", num_sparsecores=num_sparsecores)
    engine.load_state_dict(reference.state_dict())
    for step in range(STEPS):
        out = engine(random_kjt(tables, batch, seed=step, max_len=6)).values()
        (out * targets(batch, out.shape[1], step).to("tpu")).sum().backward()
    return reference, engine


def train_dense_reference(reference, make_optimizer, tables=TABLES, batch=6):
    opt = make_optimizer(reference.parameters())
    for step in range(STEPS):
        out = reference(random_kjt(tables, batch, seed=step, max_len=6)).values()
        opt.zero_grad()
        (out * targets(batch, out.shape[1], step)).sum().backward()
        opt.step()
    return reference


def assert_tables_equal(engine, reference, atol=1e-5):
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(engine.state_dict()[key].cpu(), expected, atol=atol, rtol=1e-5, msg=key)


@pytest.mark.parametrize(
    "spec, make_reference",
    [
        (optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
        ((torch.optim.SGD, {"lr": 0.1}), lambda p: torch.optim.SGD(p, lr=0.1)),
        (optim.Adagrad(lr=0.1, eps=1e-10), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)),
        ((torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.5}),
         lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.5)),
    ],
)
def test_dense_equivalent_optimizers_match_torch_optim(spec, make_reference):
    reference, engine = train_engine(spec)
    assert_tables_equal(engine, train_dense_reference(reference, make_reference))


def train_sparse_adam(reference, table, batch, lr):
    """torch.optim.SparseAdam on an EmbeddingBag(sparse=True) holding the reference's one table,
    on the same batches and loss as train_engine; returns its weight."""
    config = table[0]
    bag = torch.nn.EmbeddingBag(config.num_embeddings, config.embedding_dim, mode="sum", sparse=True)
    with torch.no_grad():
        bag.weight.copy_(reference.state_dict()[f"embedding_bags.{config.name}.weight"])
    opt = torch.optim.SparseAdam(bag.parameters(), lr=lr)
    for step in range(STEPS):
        kjt = random_kjt(table, batch, seed=step, max_len=6)
        out = torch.cat([bag(kjt[f].values(), kjt[f].offsets()[:-1]) for f in config.feature_names], dim=1)
        opt.zero_grad()
        (out * targets(batch, out.shape[1], step)).sum().backward()
        opt.step()
    return bag.weight.detach()


def test_adam_is_lazy_like_sparse_adam():
    table = [EmbeddingBagConfig(name="a", num_embeddings=17, embedding_dim=4, feature_names=["f"])]
    reference, engine = train_engine(optim.Adam(lr=0.05), tables=table)
    expected = train_sparse_adam(reference, table, 6, lr=0.05)
    torch.testing.assert_close(engine.state_dict()["embedding_bags.a.weight"].cpu(), expected, atol=1e-5, rtol=1e-5)


# Rows per SparseCore past the backward's 4096-row ranges (Update.cpp): a stack whose rows
# span many ranges, ids repeated within and across bags and features.
MANY_RANGES = [
    EmbeddingBagConfig(name="big", num_embeddings=70_000, embedding_dim=16, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="small", num_embeddings=11, embedding_dim=16, feature_names=["f2"]),
]
MANY_RANGES_BATCH = 1024


def test_updates_over_many_row_ranges_match_torch_optim():
    reference, engine = train_engine(optim.Adagrad(lr=0.1, eps=1e-10), tables=MANY_RANGES, batch=MANY_RANGES_BATCH,
                                     max_ids_per_partition=MANY_RANGES_BATCH * 6)
    assert_tables_equal(engine, train_dense_reference(reference, lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10),
                                                      tables=MANY_RANGES, batch=MANY_RANGES_BATCH))


def test_adam_over_many_row_ranges_matches_sparse_adam():
    table = MANY_RANGES[:1]
    reference, engine = train_engine(optim.Adam(lr=0.05), tables=table, batch=MANY_RANGES_BATCH,
                                     max_ids_per_partition=MANY_RANGES_BATCH * 6)
    expected = train_sparse_adam(reference, table, MANY_RANGES_BATCH, lr=0.05)
    torch.testing.assert_close(engine.state_dict()["embedding_bags.big.weight"].cpu(), expected,
                               atol=1e-5, rtol=1e-5)


def test_rowwise_adagrad_matches_a_hand_computation():
    lr, eps = 0.2, 1e-8
    reference, engine = train_engine(optim.RowWiseAdagrad(lr=lr, eps=eps))
    momentum = {name: torch.zeros(p.shape[0]) for name, p in reference.named_parameters()}
    for step in range(STEPS):
        out = reference(random_kjt(TABLES, 6, seed=step, max_len=6)).values()
        reference.zero_grad()
        (out * targets(6, out.shape[1], step)).sum().backward()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                touched = p.grad.abs().sum(1) > 0
                g = p.grad[touched]
                momentum[name][touched] += g.pow(2).mean(1)
                p[touched] -= lr * g / (momentum[name][touched].sqrt() + eps).unsqueeze(1)
    assert_tables_equal(engine, reference)


def test_no_dense_gradient_exists_and_untouched_rows_stay():
    reference, engine = train_engine(optim.SGD(lr=0.1))
    assert all(p.grad is None for p in engine.parameters())
    before = engine.state_dict()["embedding_bags.b.weight"].clone()
    out = engine(random_kjt(TABLES, 6, seed=9, max_len=2)).values()
    out.sum().backward()
    after = engine.state_dict()["embedding_bags.b.weight"]
    changed = (after != before).any(1)
    assert 0 < int(changed.sum()) < 11


@pytest.mark.parametrize(
    "spec, message",
    [
        ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "SGD.momentum=0.9 is invalid; expected its default"),
        ((torch.optim.Adam, {"lr": 0.1, "amsgrad": True}), "Adam.amsgrad=True"),
        ((torch.optim.Adagrad, {"lr_decay": 0.1}), "Adagrad.lr_decay"),
        ((torch.optim.RMSprop, {"lr": 0.1}), "torch.optim.SGD, Adagrad or Adam"),
        ((torch.optim.SGD, {"lr": 0.1, "bogus": 1}), "SGD kwargs"),
    ],
)
def test_dense_only_options_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        optim.from_torch_optim(spec)


def test_lr_scheduler_drives_the_fused_learning_rate():
    _, engine = train_engine(optim.SGD(lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(engine.fused_optimizer, step_size=1, gamma=0.5)
    engine.fused_optimizer.step()
    scheduler.step()
    assert engine.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    before = {k: v.cpu().clone() for k, v in engine.state_dict().items()}
    kjt = random_kjt(TABLES, 6, seed=11, max_len=3)
    engine(kjt).values().sum().backward()
    # Reference: one dense SGD step at lr 0.05 from the same weights.
    reference = EmbeddingBagCollection(tables=TABLES)
    reference.load_state_dict(before)
    train = torch.optim.SGD(reference.parameters(), lr=0.05)
    reference(kjt).values().sum().backward()
    train.step()
    assert_tables_equal(engine, reference, atol=1e-6)


def test_fused_optimizer_state_round_trips():
    _, engine = train_engine(optim.Adam(lr=0.05))
    saved = engine.fused_optimizer.state_dict()
    assert set(saved["state"]) == {"embedding_bags.a.weight", "embedding_bags.b.weight"}
    assert saved["state"]["embedding_bags.a.weight"]["a.exp_avg"].shape == (23, 8)
    assert int(saved["state"]["embedding_bags.a.weight"]["a.step"]) == STEPS
    _, other = train_engine(optim.Adam(lr=0.05), batch=3)
    other.load_state_dict(engine.state_dict())
    other.fused_optimizer.load_state_dict(saved)
    kjt = random_kjt(TABLES, 6, seed=12)
    for module in (engine, other):
        module(kjt).values().sum().backward()
    for key, value in engine.state_dict().items():
        torch.testing.assert_close(other.state_dict()[key], value)


def test_ftrl_matches_a_hand_computation():
    spec = optim.FTRL(lr=0.3, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1)
    reference, engine = train_engine(spec)
    p = -spec.learning_rate_power
    state = {n: (torch.full_like(w, spec.initial_accumulator_value), torch.zeros_like(w)) for n, w in reference.named_parameters()}
    for step in range(STEPS):
        out = reference(random_kjt(TABLES, 6, seed=step, max_len=6)).values()
        reference.zero_grad()
        (out * targets(6, out.shape[1], step)).sum().backward()
        with torch.no_grad():
            for name, w in reference.named_parameters():
                accum, linear = state[name]
                touched = w.grad.abs().sum(1) > 0
                g, a, wt = w.grad[touched], accum[touched], w[touched]
                new_a = a + g * g
                linear[touched] += g - (new_a.pow(p) - a.pow(p)) / spec.lr * wt
                accum[touched] = new_a
                quadratic = (new_a.pow(p) + spec.beta) / spec.lr + 2 * spec.l2_regularization_strength
                lin = linear[touched]
                l1 = spec.l1_regularization_strength
                w[touched] = torch.where(lin.abs() > l1, (torch.sign(lin) * l1 - lin) / quadratic, torch.zeros_like(lin))
    assert_tables_equal(engine, reference)


def test_rowwise_adagrad_matches_fbgemm_tbe():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    table = [EmbeddingBagConfig(name="a", num_embeddings=29, embedding_dim=8, feature_names=["f"])]
    lr, eps = 0.1, 1e-8
    reference, engine = train_engine(optim.RowWiseAdagrad(lr=lr, eps=eps), tables=table)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(29, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(reference.state_dict()["embedding_bags.a.weight"])
    for step in range(STEPS):
        kjt = random_kjt(table, 6, seed=step, max_len=6)
        out = tbe(kjt.values(), kjt.offsets())
        out.backward(targets(6, 8, step))
    torch.testing.assert_close(engine.state_dict()["embedding_bags.a.weight"].cpu(),
                               tbe.split_embedding_weights()[0].detach(), atol=1e-5, rtol=1e-5)


def test_an_lr_change_between_forward_and_backward_reaches_that_backward():
    # Bags of 3.5 ids on average take the fused_lookup path, which saves the hyperparameters
    # for its backward (bags of 1-2 ids are looked up while preprocessing).
    kjt = random_kjt(TABLES, 6, seed=5, max_len=8)
    reference = EmbeddingBagCollection(tables=TABLES)
    engine = SparseCoreEmbeddingBagCollection(TABLES, optim.SGD(lr=0.1), device="tpu")
    engine.load_state_dict(reference.state_dict())
    out = engine(kjt).values()
    engine.fused_optimizer.param_groups[0]["lr"] = 0.05  # what a scheduler's step does
    out.sum().backward()
    train = torch.optim.SGD(reference.parameters(), lr=0.05)
    reference(kjt).values().sum().backward()
    train.step()
    assert_tables_equal(engine, reference, atol=1e-6)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.SGD(lr=-0.1), "SGD.lr=-0.1 is invalid; expected a learning rate >= 0"),
        (lambda: optim.Adagrad(eps=-1.0), "Adagrad.eps=-1.0"),
        (lambda: optim.Adagrad(initial_accumulator_value=-1.0), "Adagrad.initial_accumulator_value"),
        (lambda: optim.RowWiseAdagrad(lr=-1.0), "RowWiseAdagrad.lr"),
        (lambda: optim.Adam(betas=(1.5, 0.999)), r"Adam.betas=\(1.5, 0.999\) is invalid; expected two values in \[0, 1\)"),
        (lambda: optim.FTRL(lr=0.0), "FTRL.lr=0.0 is invalid; expected a learning rate > 0"),
        (lambda: optim.FTRL(l1_regularization_strength=-1.0), "FTRL.l1_regularization_strength"),
        (lambda: optim.from_torch_optim((torch.optim.Adam, {"lr": -1.0})), "Adam.lr=-1.0"),
    ],
)
def test_hyperparameters_torch_optim_refuses_are_refused(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam])
def test_a_torch_optim_tuple_without_kwargs_takes_torch_optims_defaults(cls):
    from sparsecore.optim import from_torch_optim

    spec = from_torch_optim((cls, {}))
    reference = cls([torch.zeros(1, requires_grad=True)]).defaults
    assert spec.lr == reference["lr"]  # SGD's is 1e-3
    for name in ("eps", "betas"):
        if hasattr(spec, name):
            assert getattr(spec, name) == reference[name]
