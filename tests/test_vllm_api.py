"""The vLLM API the package relies on (``vllm_specextend/vllm_api/``), checked
against the installed vLLM's sources with ``ast``: an upgrade that renames,
moves or re-signs anything the package imports, subclasses, wraps, swaps or
reads fails here, not in production. ``scripts/check_vllm_api.py`` runs the
same check on a downloaded wheel.

Mutations that fail it: a manifest entry whose positional parameters,
member kind, swapped global or attribute no longer match the tree (below);
an import of a vLLM name the manifest does not list."""

import ast
from pathlib import Path

import pytest

import vllm
from vllm_specextend import vllm_api
from vllm_specextend.vllm_api import MANIFEST, Expect, VllmSources, check

INSTALLED = Path(vllm.__file__).resolve().parents[1]
PACKAGE = Path(vllm_api.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sources():
    return VllmSources(INSTALLED)


def test_installed_vllm_has_every_name_the_package_uses(sources):
    assert check(sources) == []


def test_every_vllm_import_of_the_package_is_in_the_manifest():
    listed = {(e.module, e.name) for e in MANIFEST} | {
        (e.module.rpartition(".")[0], e.module.rpartition(".")[2])
        for e in MANIFEST if e.kind == "module"}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module == "vllm" or node.module.startswith("vllm.")):
                missing += [f"{path.name}: from {node.module} import {alias.name}"
                            for alias in node.names if (node.module, alias.name) not in listed]
    assert missing == []


@pytest.mark.parametrize("expect, problem", [
    (Expect(vllm_api.MRV2_TD, "TargetDependentARSpeculator._prefill", "method", "mutated",
            params=("num_reqs", "attn_metadata")), "parameters start"),
    (Expect(vllm_api.MRV2_STANDALONE, "StandaloneARSpeculator.propose", "method", "mutated",
            keywords=("skip_everything",)), "no parameter(s) ['skip_everything']"),
    (Expect("vllm.config.vllm", "VllmConfig.use_v2_model_runner", "method", "mutated"),
     "is a property, expected a method"),
    (Expect(vllm_api.MRV2_SPEC, "DraftModelSpeculator.compact_block_table", "attribute",
            "mutated"), "no attribute 'compact_block_table'"),
    (Expect(vllm_api.V1_RUNNER, "NgramProposer", "global", "mutated",
            used_in="GPUModelRunner._get_draft_token_ids_cpu"), "not looked up in"),
    (Expect("vllm.v1.spec_decode.gone", "Proposer", "class", "mutated"), "module not found"),
])
def test_the_check_reports_what_no_longer_matches(sources, expect, problem):
    problems = check(sources, [expect])
    assert len(problems) == 1 and problem in problems[0], problems


def test_members_are_found_through_bases_and_self_assignments(sources):
    # Defined on DraftModelSpeculator, an instance attribute set in __init__.
    kind, _ = sources.member(vllm_api.MRV2_STANDALONE, "StandaloneARSpeculator", "block_tables")
    assert kind == "instance"
    kind, _ = sources.member(vllm_api.MRV2_STANDALONE, "StandaloneARSpeculator",
                             "_build_attn_metadata")
    assert kind == "method"


def test_a_release_missing_an_optional_name_passes_and_a_required_one_fails(tmp_path):
    module = tmp_path / "vllm" / "layers.py"
    module.parent.mkdir()
    module.write_text("class Attention:\n    def __init__(self):\n        self.impl = None\n")
    tree = VllmSources(tmp_path)
    optional = Expect("vllm.layers", "Attention.kv_cache_update_bypass", "attribute", "0.33",
                      optional=True)
    assert check(tree, [optional, Expect("vllm.layers", "Attention.impl", "attribute", "")]) == []
    required = Expect("vllm.layers", "Attention.kv_cache_update_bypass", "attribute", "")
    assert len(check(tree, [required])) == 1
