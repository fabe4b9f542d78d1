"""What the Hugging Face caches hold once a hub dataset or model has been read, made here without the hub:
the layouts of datasets 5.2 (dataset.cache_dir) and huggingface_hub 2.4 ($HF_HOME/hub)."""
import json
from pathlib import Path


def cache_hub_dataset(cache_dir: Path, repo_id: str, subset: str, split: str, rows: list[dict]) -> None:
    """``rows`` as the datasets cache holds split ``split`` of ``repo_id``'s configuration ``subset`` after
    ``load_dataset(repo_id, subset, split=split, cache_dir=cache_dir)``: <org>___<name>/<subset>/0.0.0/<hash>/."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    org, name = repo_id.split("/")
    src = cache_dir.parent / f"{name}-src" / f"{split}.parquet"
    src.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(src))
    builder = Parquet(cache_dir=str(cache_dir), dataset_name=name, config_name=subset, hash="0" * 16,
                      data_files=DataFilesDict.from_patterns({split: [str(src)]}))
    builder.download_and_prepare()
    # Built as <name>/<subset>-<id of the local files>; a hub read leaves it as <org>___<name>/<subset>.
    (cache_dir / f"{org}___{name}").mkdir()
    Path(builder.cache_dir).parent.parent.rename(cache_dir / f"{org}___{name}" / subset)


def cache_hub_model(hf_home: Path, repo_id: str, files: dict[str, dict]) -> None:
    """``files`` (name: JSON content) as the Hugging Face cache holds them after ``hf download repo_id``."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name, content in files.items():
        path = repo / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
