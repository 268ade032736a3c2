import pytest

from tests.tiny_models import TARGET_LLAMA, build_model, build_noisy_copy


@pytest.fixture(scope="session")
def target_reference():
    """Greedy outputs of the target alone, memoised for the whole run (see
    ``engine_utils.TargetAloneReference``)."""
    from tests.engine_utils import TargetAloneReference

    reference = TargetAloneReference()
    yield reference
    reference.close()


@pytest.fixture(scope="session")
def target_model():
    return build_model(TARGET_LLAMA)


@pytest.fixture(scope="session")
def draft_model():
    """A draft that agrees with the target often (acceptance about 55%)."""
    return build_noisy_copy(TARGET_LLAMA, noise=0.03)
