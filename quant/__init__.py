"""Quantization: checkpoint formats and the linear methods behind the ``awq`` and ``fp8`` plugins.

- :mod:`.awq`: the AutoAWQ GEMM format (int4 packing, RTN quantization, dequantization, config checks).
- :mod:`.awq_method`: :class:`~.awq_method.AwqLinearMethod`, the W4A16 QuantMethod.
- :mod:`.gptq`: the GPTQ format and its repacking into AWQ's (4 bits); :mod:`.gptq_method`:
  :class:`~.gptq_method.GptqLinearMethod`, which runs it as AWQ layers, and ``GptqInt8LinearMethod`` (8 bits),
  which runs it as :mod:`.w8a16` layers (:mod:`.w8a16_method`); :mod:`.pack_quantized`: compressed-tensors' int4
  and int8 formats, which load as GPTQ's (``PackQuantizedLinearMethod``, ``PackQuantizedInt8LinearMethod``).
- :mod:`.fp8`: e4m3 scaling helpers and the compressed-tensors FP8 config.
- :mod:`.fp8_method`: :class:`~.fp8_method.Fp8LinearMethod`, the W8A8 QuantMethod.
- :mod:`.fp8_block`: the block-wise FP8 format (``quant_method: "fp8"``: DeepSeek-V3, Qwen3 FP8) and its torch
  references; :mod:`.fp8_block_method`: :class:`~.fp8_block_method.BlockFp8LinearMethod`, its QuantMethod.
- :mod:`.calibrate`: the AWQ scale search behind ``infer quantize --method awq`` (data from :mod:`.calib_data`);
  :mod:`.calibrate_moe`: its mixtures of experts; :mod:`.awq_clip`: its weight clipping; :mod:`.calib_job`: what
  both ``infer quantize`` methods share (options, request checks, loading, the checkpoint writer).
- :mod:`.gptq_calibrate`: GPTQ behind ``infer quantize --method gptq``.
- :mod:`.auto_round`: AutoRound checkpoints (``quant_method: "auto-round"``), read as the GPTQ or AWQ layout they
  pack.
- :mod:`.kv_cache`: ``--kv-cache-dtype fp8``: e4m3 KV with static per-(layer, KV head) scales.
- :mod:`.forward`: cache-free forward passes over whole sequences, for calibration.
"""

from ..core.plugin_options import PluginOption

AWQ_GROUP_SIZES = (-1, 32, 64, 128)  # -1: one group over the whole input
FP8_BACKENDS = ("auto", "scaled_mm", "triton", "emulate")  # here, torch-free, for the plugins' option declarations
# the awq, gptq and compressed-tensors (int4, int8) methods' option: which batches run the fused W4A16/W8A16 kernel
FUSED_MAX_ROWS = PluginOption(64, "the largest batch that runs the fused Triton W4A16 kernel (W8A16 for 8-bit "
                              "checkpoints) on CUDA; larger ones dequantize and run a dense GEMM (0: never the fused "
                              "kernel)", minimum=0)
