import pytest
import torch

from tpengine.kernels.triton.paged_decode_attention import paged_decode_attention

pytestmark = pytest.mark.usefixtures("triton_device")


@pytest.mark.parametrize(
    "block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol",
    [
        # context 1, exactly a block, a block + 1, several blocks
        (16, 64, 2, 2, [1, 16, 17, 70], torch.float32, 1e-4),
        (32, 48, 4, 2, [33, 5], torch.float32, 1e-4),
        (256, 96, 4, 1, [256, 257], torch.float32, 1e-4),
        (16, 128, 4, 1, [40, 3], torch.float16, 1e-2),
    ],
)
def test_paged_decode_attention(
    block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol, check_decode
):
    check_decode(paged_decode_attention, block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol)


@pytest.mark.parametrize("features", [dict(window=20), dict(window=1), dict(softcap=3.0), dict(sinks=True),
                                      dict(window=70, softcap=2.0, sinks=True)], ids=str)
def test_window_softcap_and_sinks_match_reference(features, check_decode):
    # contexts shorter than, equal to and longer than each window; 130 keys span three key tiles
    check_decode(paged_decode_attention, 16, 64, 4, 2, [1, 20, 33, 70, 130], torch.float32, 1e-4, **features)


def test_paged_decode_attention_empty_context(check_empty_context):
    check_empty_context(paged_decode_attention)
