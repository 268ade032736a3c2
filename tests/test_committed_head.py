"""The committed tiny EAGLE-3 head is used only for the target it was trained for."""

import json

from tests import eagle_heads
from tests.tiny_models import DRAFT_LLAMA, TARGET_LLAMA, build_damped_attention_copy, build_model


def _commit_fake_head(fixtures, source, trained=eagle_heads.TRAINED_HEAD_VERSION):
    fixture = fixtures / "eagle3-head-w512-steps200-ttt3-seed0"
    fixture.mkdir(parents=True, exist_ok=True)
    (fixture / "trained_for.json").write_text(json.dumps(
        {"target_digest": eagle_heads.model_digest(source), "trained": trained}))
    return fixture


def test_a_committed_head_serves_only_its_own_target(tmp_path, monkeypatch):
    monkeypatch.setattr(eagle_heads, "HEAD_FIXTURES", tmp_path)
    target, other = build_model(TARGET_LLAMA), build_model(DRAFT_LLAMA)
    settings = ("eagle3", 512, 200, 0, 3)
    assert eagle_heads.committed_head(target, *settings) is None  # nothing committed

    fixture = _commit_fake_head(tmp_path, target)
    assert eagle_heads.committed_head(target, *settings) == fixture
    assert eagle_heads.committed_head(other, *settings) is None
    assert eagle_heads.committed_head(target, "eagle3", 512, 100, 0, 3) is None  # other steps

    _commit_fake_head(tmp_path, target, trained=eagle_heads.TRAINED_HEAD_VERSION - 1)
    assert eagle_heads.committed_head(target, *settings) is None


def test_model_digest_tells_a_changed_model_apart():
    plain, damped = build_model(TARGET_LLAMA), build_damped_attention_copy(TARGET_LLAMA, 0.05)
    assert eagle_heads.model_digest(plain) == eagle_heads.model_digest(plain)
    assert eagle_heads.model_digest(plain) != eagle_heads.model_digest(damped)
