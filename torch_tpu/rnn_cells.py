"""The fused LSTM and GRU cells on tpu: what nn.LSTM, nn.GRU and their cells call.

ATen's recurrent layers (aten/src/ATen/native/RNN.cpp) run a cell on any
device but the CPU as two matmuls and one fused elementwise op,
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``, whose backward is
``_thnn_fused_lstm_cell_backward_impl`` / ``_thnn_fused_gru_cell_backward``
(``_thnn_fused_lstm_cell_backward`` is a composite of its ``_impl``; under
``create_graph`` autograd calls the composite ``_thnn_differentiable_*``
backwards instead). PyTorch has kernels for these only on CUDA and XPU, so
the CPU fallback cannot run them: nn.LSTM, nn.GRU, nn.LSTMCell and nn.GRUCell
failed on tpu. The kernels here compute what the CUDA kernels
(aten/src/ATen/native/cuda/RNN.cu) compute, element for element, as tpu ops
on whole tensors:

* LSTM: gates ``i, f, g, o`` = the four H-wide column blocks of
  ``input_gates + hidden_gates + input_bias + hidden_bias``;
  ``cy = sigmoid(f) * cx + sigmoid(i) * tanh(g)``, ``hy = sigmoid(o) * tanh(cy)``;
  the workspace (B, 4H) holds the activated gates.
* GRU: ``r, z`` = sigmoid of the first two blocks of the sum,
  ``n = tanh(i_n + b_in + r * (h_n + b_hn))``, ``hy = n + z * (hx - n)``;
  the workspace (B, 5H) holds ``r, z, n, hx, h_n + b_hn``.

bf16 and fp16 compute at fp32 (the CUDA kernels' accumulate type) and round
each result once; the backward reads the rounded workspace, as CUDA's does.
"""

from __future__ import annotations

import torch

from torch_tpu.graph_breaks import hide_from_dynamo

_REDUCED = (torch.float16, torch.bfloat16)
_lib = torch.library.Library("aten", "IMPL")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _REDUCED else dtype


def _check_cell_sizes(name: str, input_gates: torch.Tensor, hidden_gates: torch.Tensor,
                      input_bias: torch.Tensor | None, hidden_bias: torch.Tensor | None, factor: int,
                      prev_hidden: torch.Tensor) -> None:
    # RNN.cu's checkSizes.
    torch._check(input_gates.dim() == 2, lambda: f"{name}: expected input_gates to be 2-D, got {input_gates.dim()}-D")
    torch._check(input_gates.shape == hidden_gates.shape,
                 lambda: f"{name}: input_gates {tuple(input_gates.shape)} and hidden_gates "
                         f"{tuple(hidden_gates.shape)} differ in size")
    gates_size = input_gates.size(1)
    torch._check((input_bias is None) == (hidden_bias is None),
                 lambda: f"{name}: input_bias and hidden_bias must be both given or both None")
    if input_bias is not None:
        torch._check(input_bias.dim() == 1 and input_bias.numel() == gates_size,
                     lambda: f"{name}: expected input_bias of size ({gates_size},), got {tuple(input_bias.shape)}")
        torch._check(input_bias.shape == hidden_bias.shape,
                     lambda: f"{name}: input_bias {tuple(input_bias.shape)} and hidden_bias "
                             f"{tuple(hidden_bias.shape)} differ in size")
    torch._check(prev_hidden.dim() == 2, lambda: f"{name}: expected the hidden state to be 2-D, got "
                                                 f"{prev_hidden.dim()}-D")
    torch._check(prev_hidden.numel() == input_gates.size(0) * gates_size // factor,
                 lambda: f"{name}: the hidden state has {prev_hidden.numel()} elements, expected "
                         f"{input_gates.size(0)} * {gates_size} / {factor}")
    tensors = [t for t in (input_gates, hidden_gates, input_bias, hidden_bias, prev_hidden) if t is not None]
    torch._check(all(t.device == input_gates.device for t in tensors),
                 lambda: f"{name}: expected all tensors on one device, got {[str(t.device) for t in tensors]}")


def _blocks(t: torch.Tensor, batch: int, count: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, count * H) -> (B, count, H) at the compute dtype."""
    return t.to(dtype).reshape(batch, count, hidden)


def fused_lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
                    input_bias: torch.Tensor | None = None,
                    hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten::_thnn_fused_lstm_cell`` -> (hy, cy, workspace)."""
    _check_cell_sizes("_thnn_fused_lstm_cell", input_gates, hidden_gates, input_bias, hidden_bias, 4, cx)
    dtype = input_gates.dtype
    acc = _compute_dtype(dtype)
    batch, hidden = input_gates.size(0), input_gates.size(1) // 4
    # ((input + hidden) + input_bias) + hidden_bias, as the kernel adds them.
    pre = input_gates.to(acc) + hidden_gates.to(acc)
    if input_bias is not None:
        pre = pre + input_bias.to(acc)
        pre = pre + hidden_bias.to(acc)
    pre = pre.reshape(batch, 4, hidden)
    gates = torch.sigmoid(pre)
    gates[:, 2] = torch.tanh(pre[:, 2])
    ig, fg, cg, og = gates.unbind(1)
    cx_flat = cx.to(acc).reshape(batch, hidden)
    cy = fg * cx_flat + ig * cg
    hy = og * torch.tanh(cy)
    workspace = gates.reshape(batch, 4 * hidden).to(dtype)
    return hy.reshape(cx.shape).to(cx.dtype), cy.reshape(cx.shape).to(cx.dtype), workspace


def fused_lstm_cell_backward_impl(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor,
                                  cy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``aten::_thnn_fused_lstm_cell_backward_impl`` -> (grad_gates, grad_cx, grad_bias)."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    name = "_thnn_fused_lstm_cell_backward_impl"
    defined = grad_hy if grad_hy is not None else grad_cy
    torch._check(defined.dim() == 2, lambda: f"{name}: expected 2-D output gradients, got {defined.dim()}-D")
    size = defined.shape
    for label, t in (("grad_hy", grad_hy), ("grad_cy", grad_cy), ("cx", cx), ("cy", cy)):
        torch._check(t is None or t.shape == size,
                     lambda: f"{name}: expected {label} of size {tuple(size)}, got {tuple(t.shape)}")
    torch._check(workspace.dim() == 2 and workspace.numel() == size[0] * size[1] * 4,
                 lambda: f"{name}: expected a 2-D workspace of {size[0] * size[1] * 4} elements, got "
                         f"{tuple(workspace.shape)}")
    dtype = workspace.dtype
    acc = _compute_dtype(dtype)
    hidden = size[1]
    ig, fg, cg, og = _blocks(workspace, size[0], 4, hidden, acc).unbind(1)
    cx_, cy_ = cx.to(acc), cy.to(acc)
    tanh_cy = torch.tanh(cy_)
    # grad of cy through hy and directly: go * o * (1 - tanh(cy)^2) + goc
    if grad_hy is not None:
        go = grad_hy.to(acc)
        gog = go * tanh_cy
        gcx = go * og * (1 - tanh_cy * tanh_cy)
        if grad_cy is not None:
            gcx = gcx + grad_cy.to(acc)
    else:
        gog = torch.zeros_like(cy_)
        gcx = grad_cy.to(acc)
    gig = gcx * cg * (1 - ig) * ig
    gfg = gcx * cx_ * (1 - fg) * fg
    gcg = gcx * ig * (1 - cg * cg)
    gog = gog * (1 - og) * og
    grad_cx = (gcx * fg).to(cx.dtype)
    grad_gates = torch.stack([gig, gfg, gcg, gog], 1).reshape(workspace.shape).to(dtype)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_cx, grad_bias


def fused_gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
                   input_bias: torch.Tensor | None = None,
                   hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::_thnn_fused_gru_cell`` -> (hy, workspace)."""
    _check_cell_sizes("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias, 3, hx)
    acc = _compute_dtype(input_gates.dtype)
    batch, hidden = input_gates.size(0), input_gates.size(1) // 3
    inp = _blocks(input_gates, batch, 3, hidden, acc)
    hid = _blocks(hidden_gates, batch, 3, hidden, acc)
    # r and z: sigmoid(((i + h) + b_i) + b_h); n: tanh((i_n + b_in) + r * (h_n + b_hn)).
    pre_rz = inp[:, :2] + hid[:, :2]
    pre_n, h_n = inp[:, 2], hid[:, 2]
    if input_bias is not None:
        b_i = input_bias.to(acc).reshape(3, hidden)
        b_h = hidden_bias.to(acc).reshape(3, hidden)
        pre_rz = pre_rz + b_i[:2]
        pre_rz = pre_rz + b_h[:2]
        pre_n = pre_n + b_i[2]
        h_n = h_n + b_h[2]
    rz = torch.sigmoid(pre_rz)
    rg, zg = rz.unbind(1)
    ng = torch.tanh(pre_n + rg * h_n)
    hx_ = hx.to(acc).reshape(batch, hidden)
    hy = ng + zg * (hx_ - ng)
    # hx goes through the compute dtype and back unchanged: the workspace holds hx itself.
    workspace = torch.cat([rz.reshape(batch, 2 * hidden), ng, hx_, h_n], 1).to(hx.dtype)
    return hy.reshape(hx.shape).to(hx.dtype), workspace


def fused_gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                       torch.Tensor | None]:
    """``aten::_thnn_fused_gru_cell_backward`` -> (grad_input_gates, grad_hidden_gates, grad_hx,
    grad_input_bias, grad_hidden_bias)."""
    name = "_thnn_fused_gru_cell_backward"
    torch._check(grad_hy.dim() == 2, lambda: f"{name}: expected a 2-D grad_hy, got {grad_hy.dim()}-D")
    batch, hidden = grad_hy.shape
    torch._check(workspace.shape == (batch, 5 * hidden),
                 lambda: f"{name}: expected a workspace of size ({batch}, {5 * hidden}), got "
                         f"{tuple(workspace.shape)}")
    dtype = workspace.dtype
    acc = _compute_dtype(dtype)
    rg, zg, ng, hx, hn = _blocks(workspace, batch, 5, hidden, acc).unbind(1)
    go = grad_hy.to(acc)
    gig = go * (hx - ng) * (1 - zg) * zg
    ghx = go * zg
    gin = go * (1 - zg) * (1 - ng * ng)
    ghn = gin * rg
    grg = gin * hn * (1 - rg) * rg
    grad_input_gates = torch.stack([grg, gig, gin], 1).reshape(batch, 3 * hidden).to(dtype)
    grad_hidden_gates = torch.stack([grg, gig, ghn], 1).reshape(batch, 3 * hidden).to(dtype)
    grad_hx = ghx.to(grad_hy.dtype)
    if has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, grad_input_gates.sum(0), grad_hidden_gates.sum(0)
    return grad_input_gates, grad_hidden_gates, grad_hx, None, None


def fused_gru_cell_meta(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
                        input_bias: torch.Tensor | None = None,
                        hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_cell_sizes("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias, 3, hx)
    batch, hidden = input_gates.size(0), input_gates.size(1) // 3
    return torch.empty_like(hx, memory_format=torch.contiguous_format), hx.new_empty(batch, 5 * hidden)


def fused_gru_cell_backward_meta(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                            torch.Tensor | None]:
    torch._check(grad_hy.dim() == 2 and workspace.shape == (grad_hy.size(0), 5 * grad_hy.size(1)),
                 lambda: "_thnn_fused_gru_cell_backward: expected a 2-D grad_hy (B, H) and a (B, 5H) workspace")
    batch, hidden = grad_hy.shape
    gates = workspace.new_empty(batch, 3 * hidden)
    grad_hx = torch.empty_like(grad_hy, memory_format=torch.contiguous_format)
    if has_bias:
        return gates, gates.clone(), grad_hx, workspace.new_empty(3 * hidden), workspace.new_empty(3 * hidden)
    return gates, gates.clone(), grad_hx, None, None


_KERNELS = {
    "_thnn_fused_lstm_cell": fused_lstm_cell,
    "_thnn_fused_lstm_cell_backward_impl": fused_lstm_cell_backward_impl,
    "_thnn_fused_gru_cell": fused_gru_cell,
    "_thnn_fused_gru_cell_backward": fused_gru_cell_backward,
}
# PyTorch has Meta kernels for the LSTM cell's ops, not the GRU cell's: shapes for
# DeferAndFuse's recording and for tracing (FakeTensor) (registered unless PyTorch has them).
_META = {
    "_thnn_fused_gru_cell": fused_gru_cell_meta,
    "_thnn_fused_gru_cell_backward": fused_gru_cell_backward_meta,
}


def _register() -> None:
    # The kernels run inside compiled functions too (the ops of a graph break): Dynamo
    # must not take them for user code and trace them (nor anything they call).
    for name, kernel in _KERNELS.items():
        _lib.impl(name, kernel, "PrivateUse1")
        hide_from_dynamo(kernel.__code__)
    for name, meta in _META.items():
        if not getattr(torch.ops.aten, name).default.has_kernel_for_dispatch_key(torch._C.DispatchKey.Meta):
            _lib.impl(name, meta, "Meta")


_register()
