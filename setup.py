"""Maps operator/, runtime/ and kernels/ into the ``eaas`` package (``package_dir`` below).

``eaas`` and ``eaas.operator`` are namespace packages: ``operator/`` must never get an
``__init__.py`` or it would shadow the standard library's ``operator`` from the repo root.
"""

from setuptools import find_namespace_packages, setup

ROOTS = {"eaas.operator": "operator", "eaas.runtime": "runtime", "eaas.kernels": "kernels"}

packages: list[str] = []
for name, directory in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_namespace_packages(directory) if "__pycache__" not in sub]

setup(
    packages=packages,
    package_dir=dict(ROOTS),
    package_data={name: ["*.json", "*.yaml", "py.typed"] for name in packages},
)
