"""The package's compiled loops are cached under a stamp of every module
(``core/compiled.py``): numba checks a cached function against its own file
only, while a caller's cache entry carries its callees' machine code."""

from pathlib import Path

import vllm_specextend
from vllm_specextend.control import plan_kernels
from vllm_specextend.core.compiled import PackageStampedLocator, package_stamp


def test_every_module_is_in_the_stamp():
    package = Path(vllm_specextend.__file__).parent
    stamped = {path for path, _, _ in package_stamp()}
    assert stamped == {str(p.relative_to(package)) for p in package.rglob("*.py")}
    assert "control/choice_kernel.py" in stamped


def test_a_kernel_calling_another_modules_kernel_is_stamped_with_the_package():
    # plan_rows carries choice_kernel's choice: its own file's stamp would
    # keep an edited choice's old code running from the cache.
    locator = plan_kernels.plan_rows._cache._impl.locator
    assert isinstance(locator, PackageStampedLocator)
    own, package = locator.get_source_stamp()
    assert package == package_stamp()
    assert own == (Path(plan_kernels.__file__).stat().st_mtime,
                   Path(plan_kernels.__file__).stat().st_size)
