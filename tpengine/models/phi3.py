"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): the Llama decoder without any bias, its checkpoints storing q, k
and v as one qkv_proj and gate and up as one gate_up_proj (loaded as FUSED tensors: split into the parts,
then each part sharded as a split checkpoint's would be, quantized ones too). A sliding_window, when set
(Phi-3-mini-4k's 2047), holds in every layer. Phi-4-mini rotates only the first partial_rotary_factor of each
head. The 128k models use LongRoPE.

LongRoPE, as transformers (5.24) computes it. transformers rotates a whole sequence with one set of factors,
picked by its length: short_factor's while it has at most original_max_position_embeddings tokens, long_factor's
once it has more (one attention factor for both). Its generate keeps that true as a sequence grows: the step
that first passes the window drops the cache and recomputes every earlier token with the long set
(Phi3ForCausalLM's prepare_inputs_for_generation). So do we, per sequence, whatever max_model_len:
- the rotary cache holds both sets, the long one's rows at position + max_positions (layers/rotary_embedding.py);
- the ledger takes a sequence's set as it admits it (long: more tokens than the window, every prompt chunk), keeps a
  short one's drafts within the window and preempts it, instead of decoding, at the token that would pass it:
  its re-prefill computes it all with the long set, as transformers' recompute (engine/scheduler.py);
- a prompt chunk says its set (PrefillChunk.long_rope); a decode or verify row's is the long one exactly when
  it attends to more tokens than the window (runner/inputs.py);
- the prefix cache chains a long sequence's blocks from their own root: no block serves the other set
  (engine/block_manager.py).
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
