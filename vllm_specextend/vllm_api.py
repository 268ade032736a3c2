"""Every vLLM name this package imports, subclasses, wraps, swaps or reads, and
a check that a vLLM source tree still has each one as the package expects.

The check reads the sources with :mod:`ast` (nothing is imported), so it runs
against the installed vLLM (``tests/test_vllm_api.py``) and against a release
that is not installed, e.g. a downloaded GPU wheel
(``scripts/check_vllm_api.py``). A class's members are looked up through its
bases inside the tree, as Python would.

Kinds of expectation:

- ``module``: the module exists;
- ``class`` / ``function``: defined (or imported) under that name in the module;
- ``method``: a function of the class (or of a base); ``params`` must appear
  in its signature in that order (positional parameters the package passes
  or receives by position), ``keywords`` anywhere in it;
- ``attribute``: readable on instances: a class-level field or assignment, a
  property, or ``self.<name> = ...`` in one of the class's methods;
- ``global``: a module-level name the package swaps, with ``used_in`` the
  function that must look it up at call time (so the swap takes effect).

The module is long because the manifest is one list, kept in one place so a
vLLM upgrade is reviewed against one file; the checker itself is short.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


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
    # ---- engine construction, metrics, memory (patches.py) --------------
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


# ---- the check ---------------------------------------------------------------


@dataclass
class _Module:
    tree: ast.Module
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    functions: dict[str, ast.AST] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)
    """local name -> (module, name) of ``from module import name``."""
    star_imports: list[str] = field(default_factory=list)
    """Modules of ``from module import *``."""
    globals: set[str] = field(default_factory=set)


class VllmSources:
    """A vLLM source tree (the directory that holds ``vllm/``), read with ast."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._modules: dict[str, _Module | None] = {}

    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            self._modules[name] = self._parse(name)
        return self._modules[name]

    def _parse(self, name: str) -> _Module | None:
        base = self.root.joinpath(*name.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                break
        else:
            return None
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = _Module(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef):
                module.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                module.functions[node.name] = node
            elif isinstance(node, ast.ImportFrom):
                source = _resolve_relative(package, node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        module.star_imports.append(source)
                    else:
                        module.imports[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    module.imports[local] = (alias.name, "")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        module.globals.add(target.id)
        return module

    def find_class(self, module_name: str, name: str, depth: int = 0
                   ) -> tuple[str, ast.ClassDef] | None:
        """The class ``name`` as seen from ``module_name`` (following imports)."""
        module = self.module(module_name)
        if module is None or depth > 8:
            return None
        if name in module.classes:
            return module_name, module.classes[name]
        if name in module.imports:
            source, original = module.imports[name]
            if original:
                return self.find_class(source, original, depth + 1)
        return None

    def find_function(self, module_name: str, name: str, depth: int = 0) -> ast.AST | None:
        module = self.module(module_name)
        if module is None or depth > 8:
            return None
        if name in module.functions:
            return module.functions[name]
        if name in module.imports:
            source, original = module.imports[name]
            if original:
                return self.find_function(source, original, depth + 1)
        for source in module.star_imports:
            found = self.find_function(source, name, depth + 1)
            if found is not None:
                return found
        return None

    def has_global(self, module_name: str, name: str) -> bool:
        module = self.module(module_name)
        if module is None:
            return False
        if (name in module.classes or name in module.functions or name in module.globals
                or name in module.imports):
            return True
        # ``vllm.envs`` resolves its variables in a module __getattr__ from a
        # table of names.
        return any(isinstance(node, ast.Constant) and node.value == name
                   for node in ast.walk(module.tree))

    def mro(self, module_name: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases found in the tree, depth first."""
        seen, order, stack = set(), [], [(module_name, cls)]
        while stack:
            mod, node = stack.pop(0)
            if (mod, node.name) in seen:
                continue
            seen.add((mod, node.name))
            order.append((mod, node))
            for base in node.bases:
                base_name = base.id if isinstance(base, ast.Name) else (
                    base.attr if isinstance(base, ast.Attribute) else None)
                if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name):
                    base_name = base.value.id
                if base_name is None:
                    continue
                found = self.find_class(mod, base_name)
                if found is not None:
                    stack.append(found)
        return order

    def member(self, module_name: str, class_name: str, member: str
               ) -> tuple[str, ast.AST] | None:
        """``(kind, node)`` of ``class_name.member``: kind ``method``,
        ``property``, ``field`` (class level) or ``instance`` (``self.x =``)."""
        found = self.find_class(module_name, class_name)
        if found is None:
            return None
        classes = self.mro(*found)
        for _, cls in classes:
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.name == member:
                    decorators = {_decorator_name(d) for d in node.decorator_list}
                    if decorators & {"property", "cached_property"}:
                        return "property", node
                    return "method", node
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and node.target.id == member:
                    return "field", node
                if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == member for t in node.targets):
                    return "field", node
        for _, cls in classes:
            for node in ast.walk(cls):
                target = None
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                for target in targets:
                    for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                        if (isinstance(item, ast.Attribute) and item.attr == member
                                and isinstance(item.value, ast.Name)
                                and item.value.id == "self"):
                            return "instance", node
        return None


def _top_level(tree: ast.Module):
    """Module-level statements, including those under ``if``/``try`` blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            stack[:0] = [*node.body, *getattr(node, "orelse", []),
                         *[s for h in getattr(node, "handlers", []) for s in h.body],
                         *getattr(node, "finalbody", [])]


def _resolve_relative(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _decorator_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _decorator_name(node.func)
    return ""


def _parameters(function: ast.AST) -> tuple[list[str], set[str], bool]:
    """(positional parameter names without ``self``, every name, has **kwargs)."""
    args = function.args  # type: ignore[attr-defined]
    positional = [a.arg for a in [*args.posonlyargs, *args.args]]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    names = set(positional) | {a.arg for a in args.kwonlyargs}
    return positional, names, args.kwarg is not None


def _check_signature(expect: Expect, function: ast.AST) -> str | None:
    positional, names, _ = _parameters(function)
    if expect.params and positional[: len(expect.params)] != list(expect.params):
        return (f"parameters start {positional[: len(expect.params) + 2]}, expected "
                f"{list(expect.params)}")
    missing = [k for k in expect.keywords if k not in names]
    if missing:
        return f"no parameter(s) {missing} (has {sorted(names)})"
    return None


def _references(function: ast.AST, name: str) -> bool:
    return any(isinstance(node, ast.Name) and node.id == name for node in ast.walk(function))


def check(sources: VllmSources, manifest: list[Expect] = MANIFEST) -> list[str]:
    """One line per expectation the tree does not meet (empty: all met)."""
    problems = []
    for expect in manifest:
        problem = _check_one(sources, expect)
        if problem is not None and not expect.optional:
            problems.append(f"{expect.module}.{expect.name} ({expect.kind}; {expect.why}): "
                            f"{problem}")
    return problems


def _check_one(sources: VllmSources, expect: Expect) -> str | None:
    if sources.module(expect.module) is None:
        return "module not found"
    if expect.kind == "module":
        return None
    if expect.kind == "class":
        return None if sources.find_class(expect.module, expect.name) else "no such class"
    if expect.kind == "function":
        function = sources.find_function(expect.module, expect.name)
        if function is None:
            return "no such function"
        return _check_signature(expect, function)
    if expect.kind == "global":
        if not sources.has_global(expect.module, expect.name):
            return "no such module-level name"
        if expect.used_in is not None:
            class_name, _, method = expect.used_in.partition(".")
            found = sources.member(expect.module, class_name, method)
            if found is None or not _references(found[1], expect.name):
                return f"not looked up in {expect.used_in} (a swap would not take effect)"
        return None
    class_name, _, member = expect.name.partition(".")
    found = sources.member(expect.module, class_name, member)
    if found is None:
        return f"no {expect.kind} {member!r} on {class_name} or its bases"
    kind, node = found
    if expect.kind == "method":
        if kind != "method":
            return f"is a {kind}, expected a method"
        return _check_signature(expect, node)
    return None


def absent_optional(sources: VllmSources, manifest: list[Expect] = MANIFEST) -> list[str]:
    """The optional names this tree does not have (fine: checked at run time)."""
    return [f"{e.module}.{e.name}" for e in manifest
            if e.optional and _check_one(sources, e) is not None]


def format_report(problems: list[str], root: Path, version: str | None,
                  optional_absent: list[str] = ()) -> str:
    lines = [f"vLLM sources: {root}" + (f" (vLLM {version})" if version else ""),
             f"expectations: {len(MANIFEST)}; unmet: {len(problems)}"]
    lines += [f"  UNMET {p}" for p in problems]
    lines += [f"  absent, optional: {name}" for name in optional_absent]
    return "\n".join(lines)


def source_version(root: Path) -> str | None:
    """The version a source tree declares (``vllm/_version.py``), if any."""
    path = Path(root) / "vllm" / "_version.py"
    if not path.is_file():
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in ("__version__", "version")
                for t in node.targets) and isinstance(node.value, ast.Constant):
            return str(node.value.value)
    return None
