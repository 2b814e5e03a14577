from setuptools import setup

version = {}
with open("abft/_version.py") as f:
    exec(f.read(), version)

setup(
    name="abft",
    version=version["__version__"],
    description="Checked GEMMs (Huang-Abraham checksums) against silent data corruption in training",
    python_requires=">=3.10",
    packages=["abft", "abft.detectors", "abft.guard", "abft.integrations", "abft.kernels", "abft.eval",
              "abft.bench"],
    package_dir={"abft": "abft", "abft.kernels": "kernels", "abft.eval": "eval", "abft.bench": "bench"},
    package_data={"abft.kernels": ["csrc/*.cpp"]},      # compiled on first use (kernels/compiled.py)
    install_requires=["torch>=2.4", "numpy", "matplotlib"],
    extras_require={
        "triton": ["triton"],
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "hypothesis", "transformers", "accelerate",
                 "expecttest"],
    },
    entry_points={"console_scripts": ["abft=abft.cli:main"]},
)
