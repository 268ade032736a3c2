"""The manifest: every vLLM name this package imports, subclasses, wraps,
swaps or reads, with why (:class:`Expect`; the kinds are listed in the
package docstring).

One list, kept in one place so that a vLLM upgrade is reviewed against one
file; it is long for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expect:
    module: str
    name: str
    """``Class``, ``Class.member`` or a module-level ``name``."""
    kind: str
    why: str
    params: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    used_in: str | None = None
    optional: bool = False
    """Present in some supported releases only (the package checks with ``getattr``)."""


def _members(module: str, cls: str, kind: str, names: str, why: str) -> list[Expect]:
    return [Expect(module, f"{cls}.{name}", kind, why) for name in names.split()]


V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V1_BASE = "vllm.v1.spec_decode.llm_base_proposer"
MRV2_RUNNER = "vllm.v1.worker.gpu.model_runner"
MRV2_SPEC = "vllm.v1.worker.gpu.spec_decode.speculator"
MRV2_STANDALONE = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator"
MRV2_TD = "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator"
CONFIG = "vllm.config"

TAPPED_BACKENDS = [
    ("FlashAttentionBackend", "FlashAttentionImpl", "vllm.v1.attention.backends.flash_attn"),
    ("FlashInferBackend", "FlashInferImpl", "vllm.v1.attention.backends.flashinfer"),
    ("TritonAttentionBackend", "TritonAttentionImpl", "vllm.v1.attention.backends.triton_attn"),
    ("CPUAttentionBackend", "CPUAttentionBackendImpl", "vllm.v1.attention.backends.cpu_attn"),
]
"""Attention backends whose layers the tap wraps (backend class, impl class, module)."""

MANIFEST: list[Expect] = [
    # ---- imports --------------------------------------------------------
    Expect("vllm.config", "VllmConfig", "class", "imported (adapters)"),
    Expect("vllm.config", "get_layers_from_vllm_config", "function", "finds attention layers"),
    Expect("vllm.config", "set_current_vllm_config", "function", "tests"),
    Expect("vllm.config.compilation", "CUDAGraphMode", "class", "MRV2 step-0 metadata"),
    *_members("vllm.config.compilation", "CUDAGraphMode", "attribute",
              "NONE FULL PIECEWISE FULL_AND_PIECEWISE FULL_DECODE_ONLY",
              "graph modes read or dispatched"),
    Expect("vllm.model_executor.layers.attention", "Attention", "class", "attention layers"),
    Expect("vllm.model_executor.models.utils", "extract_layer_index", "function",
           "picks the target's last layer"),
    Expect("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbeddingBase", "class",
           "the draft's RoPE (compact positions)"),
    *_members("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbeddingBase",
              "method", "_compute_inv_freq", "RoPE frequencies for re-positioning"),
    *_members("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbeddingBase",
              "attribute", "base rotary_dim is_neox_style", "RoPE layout"),
    Expect("vllm.v1.kv_cache_interface", "KVCacheConfig", "class", "KV cache set-up"),
    *_members("vllm.v1.kv_cache_interface", "KVCacheConfig", "attribute",
              "num_blocks kv_cache_groups", "tap / KV copy sizing, the shared group"),
    *_members("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "attribute",
              "layer_names kv_cache_spec", "the target's and draft's shared group"),
    *_members("vllm.v1.kv_cache_interface", "AttentionSpec", "attribute",
              "block_size page_size_bytes", "memory accounting"),
    Expect("vllm.v1.attention.backend", "CommonAttentionMetadata", "class", "V1 draft metadata"),
    *_members("vllm.v1.attention.backend", "CommonAttentionMetadata", "attribute",
              "query_start_loc query_start_loc_cpu seq_lens block_table_tensor num_reqs "
              "num_actual_tokens seq_lens_cpu_upper_bound _num_computed_tokens_cache",
              "read and replaced for the compacted view"),
    *_members("vllm.v1.attention.backend", "CommonAttentionMetadata", "method", "replace",
              "a compacted copy"),
    *_members("vllm.v1.attention.backend", "AttentionBackend", "attribute",
              "forward_includes_kv_cache_update", "tap needs a separate KV update"),
    *[expect for backend, impl, module in TAPPED_BACKENDS for expect in (
        Expect(module, f"{backend}.forward_includes_kv_cache_update", "attribute",
               "the tap needs a separate KV update"),
        Expect(module, f"{impl}.do_kv_cache_update", "method", "wrapped by the tap / KV copy",
               params=("layer", "key", "value", "kv_cache", "slot_mapping")),
        Expect(module, f"{impl}.forward", "method", "wrapped by the tap",
               params=("layer", "query", "key", "value", "kv_cache", "attn_metadata")),
        Expect(module, f"{impl}.scale", "attribute", "score scale"),
    )],
    Expect("vllm.model_executor.layers.attention.attention", "Attention.impl", "attribute",
           "its class is swapped for the tap and the plain draft KV copy"),
    *_members("vllm.model_executor.layers.attention.attention", "Attention", "attribute",
              "num_heads num_kv_heads head_size kv_cache", "tap buffers, KV copy writes"),
    *_members("vllm.model_executor.layers.attention.attention", "Attention", "method",
              "get_attn_backend", "backend check"),
    Expect("vllm.model_executor.layers.attention.attention", "Attention.kv_cache_update_bypass",
           "attribute", "refused when set (KV written in a fused op)", optional=True),
    Expect("vllm.distributed", "get_tensor_model_parallel_world_size", "function",
           "tensor-parallel score all-reduce"),
    Expect("vllm.distributed", "tensor_model_parallel_all_reduce", "function",
           "tensor-parallel score all-reduce"),
    Expect("vllm.distributed", "model_parallel_is_initialized", "function",
           "tensor-parallel score all-reduce"),
    Expect("vllm.logger", "init_logger", "function", "the package's logger"),
    Expect("vllm.triton_utils.dispatcher", "", "module", "CPU expand_kernel fix"),
    Expect("vllm.triton_utils.dispatcher", "register_kernels", "function",
           "CPU expand_kernel fix"),
    Expect("vllm.triton_utils.dispatcher", "KernelOverride", "class", "CPU expand_kernel fix"),
    Expect("vllm.triton_utils.dispatcher", "KernelOverride.func", "attribute",
           "CPU expand_kernel fix: the registered implementation"),
    Expect("vllm.v1.sample.rejection_sampler", "", "module", "CPU expand_kernel fix"),
    Expect("vllm.v1.sample.rejection_sampler", "expand_kernel", "function",
           "registered name of the CPU expand_kernel fix"),
    Expect("vllm.v1.worker.worker_base", "WorkerBase", "class",
           "gains spec_extend_metrics for collective_rpc"),
    *_members("vllm.v1.worker.worker_base", "WorkerBase", "attribute", "model_runner",
              "metrics read the drafter"),
    Expect("vllm.envs", "VLLM_USE_V2_MODEL_RUNNER", "global", "runner choice"),
    # ---- configs read -----------------------------------------------------
    *_members("vllm.config.vllm", "VllmConfig", "attribute",
              "additional_config speculative_config model_config scheduler_config "
              "parallel_config cache_config kv_transfer_config attention_config "
              "compilation_config max_concurrent_batches", "options and checks"),
    Expect("vllm.config.vllm", "VllmConfig.use_v2_model_runner", "attribute",
           "wrapped (property): runner choice"),
    Expect("vllm.config.vllm", "envs", "global", "runner choice reads VLLM_USE_V2_MODEL_RUNNER"),
    *_members("vllm.config.speculative", "SpeculativeConfig", "attribute",
              "method num_speculative_tokens parallel_drafting draft_model_config "
              "kv_cache_dtype", "which drafter, its window"),
    *_members("vllm.config.speculative", "SpeculativeConfig", "method",
              "uses_draft_model use_gemma4_mtp use_step3p5_mtp use_multi_module_mtp",
              "method checks"),
    *_members("vllm.config.model", "ModelConfig", "attribute",
              "max_model_len is_hybrid is_attention_free hf_text_config hf_config uses_mrope "
              "model served_model_name", "window, full attention, M-RoPE"),
    *_members("vllm.config.model", "ModelConfig", "method",
              "get_sliding_window get_num_layers get_hidden_size", "checks"),
    *_members("vllm.config.scheduler", "SchedulerConfig", "attribute",
              "async_scheduling max_num_batched_tokens max_num_seqs enable_chunked_prefill "
              "max_num_encoder_input_tokens encoder_cache_size",
              "scheduler checks, prompt chunk cap"),
    *_members("vllm.config.cache", "CacheConfig", "attribute",
              "block_size cache_dtype enable_prefix_caching num_gpu_blocks",
              "chunks, fp8 refusal, private layouts"),
    *_members("vllm.config.parallel", "ParallelConfig", "attribute",
              "decode_context_parallel_size prefill_context_parallel_size data_parallel_size "
              "enable_dbo ubatch_size", "refusals"),
    *_members("vllm.config.attention", "AttentionConfig", "attribute", "hisparse_config",
              "runner choice"),
    # ---- engine construction, metrics, memory (patches/) ----------------
    Expect("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "method",
           "wrapped: options validated at construction"),
    *_members("vllm.engine.arg_utils", "EngineArgs", "attribute",
              "max_num_batched_tokens async_scheduling additional_config",
              "read / set before the config is built"),
    Expect("vllm.v1.engine.core", "EngineCore._initialize_kv_caches", "method",
           "wrapped: private layout blocks", params=("vllm_config",)),
    Expect("vllm.v1.engine.llm_engine", "LLMEngine.get_metrics", "method", "wrapped: metrics"),
    *_members("vllm.v1.engine.llm_engine", "LLMEngine", "method", "collective_rpc",
              "worker metrics"),
    Expect("vllm.v1.engine.async_llm", "AsyncLLM.do_log_stats", "method", "wrapped: metrics"),
    *_members("vllm.v1.engine.async_llm", "AsyncLLM", "method", "collective_rpc",
              "worker metrics"),
    Expect("vllm.v1.engine.async_llm", "AsyncLLM.errored", "attribute", "metrics"),
    Expect("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory", "method",
           "wrapped: retrieval's copies counted"),
    Expect("vllm.v1.worker.cpu_worker", "CPUWorker.determine_available_memory", "method",
           "wrapped: retrieval's copies counted"),
    # ---- the V1 runner and drafters ---------------------------------------
    Expect(V1_RUNNER, "GPUModelRunner.__init__", "method", "wrapped: drafter class swap",
           params=("vllm_config",)),
    Expect(V1_RUNNER, "DraftModelProposer", "global", "swapped while the runner is built",
           used_in="GPUModelRunner.__init__"),
    Expect(V1_RUNNER, "EagleProposer", "global", "swapped while the runner is built",
           used_in="GPUModelRunner.__init__"),
    Expect(V1_RUNNER, "GPUModelRunner.initialize_kv_cache", "method",
           "wrapped: hooked layers' impl classes assigned after it", params=("kv_cache_config",)),
    Expect(V1_RUNNER, "GPUModelRunner._get_draft_token_ids_cpu", "method",
           "wrapped: goodput draft lengths"),
    Expect(V1_RUNNER, "GPUModelRunner._input_fits_in_drafter", "method",
           "replaced: every row drafts", params=("common_attn_metadata",)),
    *_members(V1_RUNNER, "GPUModelRunner", "attribute", "drafter input_batch",
              "drafter, request rows"),
    *_members(V1_RUNNER, "GPUModelRunner", "method", "get_kv_cache_spec",
              "memory accounting"),
    *_members("vllm.v1.worker.block_table", "BlockTable", "method", "get_numpy_array",
              "goodput control reads each request's blocks"),
    *_members("vllm.v1.attention.backend", "CommonAttentionMetadata", "attribute",
              "slot_mapping", "catch-up slot mappings"),
    Expect("vllm.v1.worker.gpu_input_batch", "InputBatch", "class", "V1 rows"),
    *_members("vllm.v1.worker.gpu_input_batch", "InputBatch", "attribute",
              "req_ids num_computed_tokens_cpu num_prompt_tokens block_table",
              "planning batch, goodput control"),
    Expect("vllm.v1.spec_decode.draft_model", "DraftModelProposer", "class", "subclassed"),
    Expect("vllm.v1.spec_decode.eagle", "EagleProposer", "class", "subclassed"),
    Expect("vllm.v1.spec_decode.draft_model", "DraftModelProposer.__init__", "method",
           "mixin init", params=("vllm_config", "device", "runner")),
    Expect("vllm.v1.spec_decode.eagle", "EagleProposer.__init__", "method", "mixin init",
           params=("vllm_config", "device", "runner")),
    Expect(V1_BASE, "SpecDecodeBaseProposer.load_model", "method", "overridden",
           params=("target_model",)),
    Expect(V1_BASE, "SpecDecodeBaseProposer.initialize_attn_backend", "method", "overridden",
           params=("kv_cache_config", "kernel_block_sizes")),
    Expect(V1_BASE, "SpecDecodeBaseProposer.propose", "method", "overridden",
           keywords=("num_speculative_tokens", "target_positions", "common_attn_metadata",
                     "token_indices_to_sample", "target_hidden_states")),
    Expect(V1_BASE, "SpecDecodeBaseProposer._get_positions", "method", "overridden",
           params=("num_tokens",)),
    Expect(V1_BASE, "SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata", "method",
           "overridden: compacted metadata", params=("common_attn_metadata", "draft_index")),
    *_members(V1_BASE, "SpecDecodeBaseProposer", "attribute",
              "max_batch_size max_model_len max_num_tokens dtype device vllm_config model "
              "block_size kv_cache_gid _draft_attn_layer_names needs_extra_input_slots",
              "read by the adapters"),
    # ---- Model Runner V2 --------------------------------------------------
    Expect(MRV2_RUNNER, "GPUModelRunner.__init__", "method", "wrapped: speculator swap",
           params=("vllm_config", "device")),
    Expect(MRV2_RUNNER, "init_speculator", "global", "swapped while the runner is built",
           used_in="GPUModelRunner.__init__"),
    Expect(MRV2_RUNNER, "GPUModelRunner.initialize_kv_cache", "method",
           "wrapped: hooked layers' impl classes assigned after it", params=("kv_cache_config",)),
    *_members(MRV2_RUNNER, "GPUModelRunner", "attribute", "speculator",
              "memory accounting, metrics"),
    *_members(MRV2_RUNNER, "GPUModelRunner", "method", "get_kv_cache_spec",
              "memory accounting"),
    Expect("vllm.v1.worker.gpu.spec_decode", "init_speculator", "function",
           "its signature is mirrored", params=("vllm_config", "device")),
    Expect(MRV2_STANDALONE, "StandaloneARSpeculator", "class", "subclassed"),
    Expect("vllm.v1.worker.gpu.spec_decode.eagle.speculator", "EagleSpeculator", "class",
           "subclassed"),
    Expect("vllm.v1.worker.gpu.spec_decode.mtp.speculator", "MTPSpeculator", "class",
           "subclassed"),
    Expect(MRV2_SPEC, "DraftModelSpeculator.__init__", "method", "mixin init",
           params=("vllm_config", "device")),
    Expect(MRV2_SPEC, "DraftModelSpeculator.load_model", "method", "overridden",
           params=("target_model",)),
    Expect(MRV2_SPEC, "DraftModelSpeculator.set_attn", "method", "overridden",
           params=("model_state", "kv_cache_config", "block_tables", "target_input_buffers",
                   "target_attn_groups")),
    Expect(MRV2_SPEC, "DraftModelSpeculator._build_attn_metadata", "method",
           "overridden (compacted overlay); called for step 0",
           keywords=("num_reqs", "batch_desc", "query_start_loc_np",
                     "seq_lens_cpu_upper_bound", "step")),
    Expect(MRV2_SPEC, "DraftModelSpeculator._update_draft_decode_metadata", "method",
           "overridden", params=("attn_metadata", "num_reqs")),
    *_members(MRV2_SPEC, "DraftModelSpeculator", "attribute",
              "max_num_reqs max_model_len max_num_tokens dtype vllm_config "
              "draft_attn_layer_names input_buffers block_tables draft_is_prefilling model",
              "read by the adapters"),
    Expect(MRV2_STANDALONE, "StandaloneARSpeculator.propose", "method", "overridden",
           params=("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
                   "aux_hidden_states", "num_sampled", "num_rejected"),
           keywords=("dummy_run", "num_speculative_tokens")),
    Expect(MRV2_STANDALONE, "StandaloneARSpeculator._run_model", "method",
           "overridden: compact positions", params=("input_ids", "positions")),
    Expect(MRV2_TD, "TargetDependentARSpeculator.propose", "method", "overridden",
           params=("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
                   "aux_hidden_states", "num_sampled", "num_rejected"),
           keywords=("dummy_run", "mm_inputs", "num_speculative_tokens")),
    Expect(MRV2_TD, "TargetDependentARSpeculator._prefill", "method",
           "overridden: compacted step-0 metadata; replays run it eagerly",
           params=("num_reqs", "num_tokens", "attn_metadata", "slot_mappings"),
           keywords=("num_tokens_across_dp", "mm_inputs")),
    Expect(MRV2_TD, "TargetDependentARSpeculator._run_model", "method",
           "overridden: compact positions", params=("num_tokens",)),
    Expect(MRV2_TD, "TargetDependentARSpeculator.init_cudagraph_manager", "method",
           "wrapped: its managers' methods rebound after it", params=("cudagraph_mode",)),
    Expect(MRV2_TD, "TargetDependentARSpeculator._fused_multi_step_decode", "method",
           "overridden: compacted tables in replays"),
    *_members(MRV2_TD, "TargetDependentARSpeculator", "attribute",
              "prefill_cudagraph_manager decode_cudagraph_manager", "wrapped"),
    *_members("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils",
              "SpeculatorCudaGraphManager", "method", "run_fullgraph capture",
              "rebound on the instance"),
    Expect("vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor", "class",
           "step-0 metadata build"),
    *_members("vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor", "attribute",
              "cg_mode num_tokens num_reqs", "step-0 metadata build"),
    *_members("vllm.v1.worker.gpu.block_table", "BlockTables", "attribute",
              "input_block_tables block_sizes", "compacted overlay"),
    *_members("vllm.v1.worker.gpu.block_table", "BlockTables", "method",
              "get_dummy_block_tables", "overlaid for capture"),
    *_members("vllm.v1.worker.gpu.input_batch", "InputBatch", "attribute",
              "num_reqs num_tokens req_ids query_start_loc query_start_loc_np seq_lens "
              "seq_lens_cpu_upper_bound positions num_computed_tokens_np prefill_len_np "
              "is_prefilling_np", "planning batch"),
    *_members("vllm.v1.worker.gpu.input_batch", "InputBuffers", "attribute",
              "seq_lens positions query_start_loc", "compacted overlay, positions"),
]
