"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): the Llama decoder without any bias, its checkpoints storing q, k
and v as one qkv_proj and gate and up as one gate_up_proj (loaded as FUSED tensors: split into the parts,
then each part sharded as a split checkpoint's would be, quantized ones too). A sliding_window, when set
(Phi-3-mini-4k's 2047), holds in every layer. Phi-4-mini rotates only the first partial_rotary_factor of each
head. The 128k models use LongRoPE.

LongRoPE, and where we differ from transformers. transformers (5.24) rotates a whole sequence with one set of
factors, picked by its length: short_factor's while it has at most original_max_position_embeddings tokens,
long_factor's once it has more. Its generate keeps that true as a sequence grows: the step that first passes the
window drops the cache and recomputes every earlier token with the long set (Phi3ForCausalLM's
prepare_inputs_for_generation). We pick one set per engine, as vLLM does (layers/rotary_embedding.py): the long
one when max_model_len passes the window, else the short one; K/V are never recomputed, so a token's K/V stay a
function of its tokens and position, and prefix hits, chunked prefill and preemption all hold. So:
- max_model_len <= original_max_position_embeddings: no sequence can pass the window, and the short set is what
  transformers uses for all of them: the same tokens.
- max_model_len past the window: the long set everywhere; the same as transformers for a sequence past the
  window (a prompt longer than it from the start; and, once generation passes it, every later step, where
  transformers has recomputed the sequence with the long set: the same K/V for the same tokens), and not for a
  sequence within the window,
  which transformers rotates with the short set.
Matching transformers for both needs a set per sequence and a recompute of its K/V when it first passes the
window (a preemption, with the prefix cache keyed by the set): not done.
"""
from tpengine.hf_config import HFConfig
from tpengine.layers.linear import FUSED
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    # the fused tensors of Phi-3's checkpoints; split q/k/v and gate/up (a converted checkpoint's) load too
    packed_modules_mapping = {**DecoderForCausalLM.packed_modules_mapping,
                              "qkv_proj": ("qkv_proj", FUSED), "gate_up_proj": ("gate_up_proj", FUSED)}

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily()
