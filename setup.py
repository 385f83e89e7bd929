"""Package discovery for the root-as-package layout: every folder with an ``__init__.py`` under the
repository root is a ``splitserve`` subpackage, except those that do not ship (tests, benchmarks, scripts)."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "benchmarks", "benchmarks.*", "scripts", "scripts.*", "docs", "build", "build.*"]


class BuildPy(build_py):
    """The root's modules are the package's, except this file."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("splitserve", "setup")]


setup(
    packages=["splitserve", *(f"splitserve.{name}" for name in find_packages(".", exclude=NOT_SHIPPED))],
    cmdclass={"build_py": BuildPy},
)
