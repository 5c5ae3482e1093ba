"""Package layout: contract/, engine/, sidecar/ and operator/ are each a source root holding one
slice of the `headroom` namespace (engine/headroom/engine, ...), so no top-level `operator`,
`engine` or `sidecar` package exists to shadow the standard library."""

from setuptools import find_namespace_packages, setup

ROOTS = ("contract", "engine", "sidecar", "operator")
packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    for pkg in find_namespace_packages(root, include=["headroom.*"]):
        packages.append(pkg)
        package_dir[pkg] = f"{root}/" + pkg.replace(".", "/")

setup(packages=packages, package_dir=package_dir)
