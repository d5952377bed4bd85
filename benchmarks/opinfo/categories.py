"""Coarse op categories for reporting the OpInfo conformance run."""

from __future__ import annotations

from torch.testing._internal.opinfo.core import (
    BinaryUfuncInfo,
    OpInfo,
    ReductionOpInfo,
    ShapeFuncInfo,
    SpectralFuncInfo,
    UnaryUfuncInfo,
)

CATEGORIES = (
    "elementwise unary",
    "elementwise binary",
    "reduction",
    "linalg",
    "shape/view",
    "indexing",
    "nn.functional",
    "fft",
    "factory/conversion",
    "other",
)

_LINALG = {
    "addmm", "addmv", "addbmm", "baddbmm", "addr", "dot", "vdot", "bmm", "mm", "mv", "matmul",
    "__rmatmul__", "outer", "inner", "kron", "tensordot", "einsum", "cholesky", "cholesky_inverse",
    "cholesky_solve", "geqrf", "lu", "lu_solve", "lu_unpack", "matrix_exp", "ormqr", "qr", "svd",
    "pinverse", "logdet", "triangular_solve", "trace", "chain_matmul", "cdist", "dist", "cross",
    "block_diag", "cov", "corrcoef", "diag", "diag_embed", "diagflat", "tril", "triu",
}
_SHAPE = {
    "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to", "broadcast_tensors", "broadcast_shapes",
    "cat", "_chunk_cat", "chunk", "unsafe_chunk", "column_stack", "contiguous", "clone", "dstack",
    "expand", "expand_as", "expand_copy", "flatten", "flip", "fliplr", "flipud", "hsplit", "hstack",
    "movedim", "mT", "mH", "T", "H", "narrow", "narrow_copy", "permute", "permute_copy", "ravel",
    "repeat", "repeat_interleave", "reshape", "reshape_as", "roll", "rot90", "select", "slice",
    "split", "split_with_sizes", "split_with_sizes_copy", "unsafe_split", "squeeze", "squeeze_copy",
    "stack", "t", "t_copy", "tensor_split", "tile", "transpose", "transpose_copy", "unbind",
    "unbind_copy", "unflatten", "unfold", "unfold_copy", "unsqueeze", "unsqueeze_copy", "view",
    "view_as", "view_copy", "vsplit", "vstack", "dsplit", "as_strided", "as_strided_copy",
    "alias_copy", "diagonal", "diagonal_copy", "sum_to_size", "view_as_real", "view_as_complex",
    "meshgrid", "resize_", "resize_as_", "conj", "conj_physical", "resolve_conj", "resolve_neg",
    "positive", "real", "combinations", "cartesian_prod", "unravel_index", "constant_pad_nd",
}
_INDEXING = {
    "gather", "scatter", "scatter_add", "scatter_reduce", "index_fill", "index_copy",
    "index_select", "index_add", "index_reduce", "index_put", "_unsafe_masked_index",
    "_unsafe_masked_index_put_accumulate", "__getitem__", "put", "take", "take_along_dim",
    "masked_fill", "masked_scatter", "masked_select", "where", "nonzero", "nonzero_static",
    "argwhere", "diagonal_scatter", "select_scatter", "slice_scatter", "as_strided_scatter",
    "sort", "argsort", "msort", "topk", "kthvalue", "unique", "unique_consecutive", "searchsorted",
    "bucketize", "bincount", "histc", "histogram", "histogramdd", "tril_indices", "triu_indices",
    "isin", "_segment_reduce", "fill", "zero_",
}
_FACTORY = {
    "arange", "linspace", "logspace", "eye", "ones", "zeros", "full", "empty", "empty_strided",
    "empty_permuted", "scalar_tensor", "ones_like", "zeros_like", "full_like", "empty_like",
    "new_ones", "new_zeros", "new_full", "new_empty", "new_empty_strided", "to", "item", "complex",
    "polar", "bfloat16", "bool", "byte", "char", "double", "float", "half", "int", "long",
    "short", "cdouble", "cfloat", "chalf", "hash_tensor",
}
_ELEMENTWISE_NARY = {"addcmul", "addcdiv", "clamp", "lerp", "logaddexp2"}
"""Elementwise ops of two or more tensors without a BinaryUfuncInfo: reported as binary."""
_REDUCTION_LIKE = {
    "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "logsumexp", "median", "nanmedian",
    "mode", "quantile", "nanquantile", "var_mean", "std_mean", "aminmax", "max", "min", "norm",
    "renorm", "equal", "allclose", "trapz", "trapezoid", "cumulative_trapezoid", "diff", "gradient",
}


def categorize(op: OpInfo) -> str:
    """A coarse category for reporting, from the op's name and OpInfo class."""
    name = op.name
    base = name.split(".")[0] if not name.startswith(("nn.", "linalg.", "fft.", "special.")) else name
    if name.startswith("nn.functional.") or name in {
        "softmax", "log_softmax", "_softmax_backward_data", "native_layer_norm",
        "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
        "_batch_norm_with_update", "max_pool2d_with_indices_backward", "native_dropout_backward",
        "grid_sampler_2d", "grid_sampler_3d", "_upsample_bilinear2d_aa",
        "torch.ops.aten._safe_softmax.default",
    }:
        return "nn.functional"
    if name.startswith("linalg.") or name in _LINALG:
        return "linalg"
    if name.startswith("fft.") or isinstance(op, SpectralFuncInfo) or name in {"stft", "istft"}:
        return "fft"
    if name in {"max", "min"} and op.variant_test_name == "binary":
        return "elementwise binary"
    if isinstance(op, ReductionOpInfo) or name in _REDUCTION_LIKE:
        return "reduction"
    if isinstance(op, ShapeFuncInfo) or base in _SHAPE:
        return "shape/view"
    if base in _INDEXING:
        return "indexing"
    if base in _FACTORY or name.startswith("signal.windows."):
        return "factory/conversion"
    if isinstance(op, UnaryUfuncInfo):
        return "elementwise unary"
    if isinstance(op, BinaryUfuncInfo) or name in _ELEMENTWISE_NARY:
        return "elementwise binary"
    if name.startswith("special."):
        return "elementwise binary" if name in {"special.xlog1py", "special.zeta"} or "polynomial" in name else "elementwise unary"
    if name.startswith("masked."):
        return "reduction"
    return "other"
