"""torch.autocast("tpu"): matmuls in bf16, fp32-policy ops stay fp32."""

import torch


def test_matmul_runs_in_bf16_under_autocast():
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        y = a.to("tpu") @ b.to("tpu")
        z = torch.nn.functional.linear(a.to("tpu"), b.t().to("tpu"))
    assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = a @ b
    torch.testing.assert_close(y.cpu(), reference)


def test_fp32_policy_and_untouched_ops():
    x = torch.randn(4, 10, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert torch.exp(x.bfloat16()).dtype == torch.float32
        assert torch.nn.functional.mse_loss(x.bfloat16(), x.bfloat16()).dtype == torch.float32
        assert (x + 1).dtype == torch.float32


def test_autocast_training_step_matches_cpu_autocast():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    tpu_model = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(model)]).to("tpu")
    x = torch.randn(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu_loss = model(x).float().pow(2).mean()
    cpu_loss.backward()
    with torch.autocast("tpu", dtype=torch.bfloat16):
        tpu_loss = tpu_model(x.to("tpu")).float().pow(2).mean()
    tpu_loss.backward()
    torch.testing.assert_close(tpu_loss.cpu(), cpu_loss)
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad)


def test_autocast_without_a_dtype_takes_bf16_on_the_backend_s_threads():
    # PyTorch's default for a PrivateUse1 backend is fp16; the TPU's lower precision is bf16.
    import torch_tpu.threads

    a = torch.randn(4, 4, device="tpu")

    def product_dtype():
        with torch.autocast("tpu"):
            return (a @ a).dtype

    assert product_dtype() == torch.bfloat16
    assert torch_tpu.threads.worker("autocast-test").submit(product_dtype).result(timeout=30) == torch.bfloat16
    assert torch.tpu.submit(torch.tpu.Stream(), product_dtype).result(timeout=30) == torch.bfloat16
