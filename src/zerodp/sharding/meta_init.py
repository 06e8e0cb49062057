"""Born sharded: build a model on the meta device, then materialise it one module at a time.

`with zerodp.init(config): model = MyModel()` constructs every parameter on the meta
device (no memory). `zerodp.initialize` then walks `model.modules()` in order, gives each
module's own parameters real storage and calls that module's `reset_parameters()`. Eager
construction calls the same methods in the same order from the modules' constructors,
so with the same seed the values are identical, as long as the model initialises its
weights in `reset_parameters()` (every torch.nn layer does; the bundled GPT does) rather
than in a later pass over the whole model. Hugging Face models do exactly that (`post_init`)
and give most of their modules (RMSNorm, rotary embeddings) no reset_parameters; they
define a per-module initialiser instead, `_init_weights(module)`, which every module of
theirs with parameters of its own is then also passed to, after its reset_parameters if it
has one. That loads pretrained weights without the model whole on any rank (the values
drawn do not matter: `load_pretrained` overwrites them). It is not HF's eager
initialisation: HF's pass also visits modules without parameters of their own, which some
models (T5) use to initialise their children, and zerodp.init does not; so to train a
Hugging Face model from scratch, build it eagerly. As soon as every parameter of a stage-3 unit
is real, the unit is sharded and its full copy freed, so a rank never holds more than
the units being built plus the root's own parameters.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from ..config import Config
from ..distributed import Comm

# Modules built under zerodp.init and not yet materialised -> the handle of their guard
# (`_guard_unbuilt`). Weak: a model dropped before initialize takes its entry with it.
_GUARDS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def init(config: Optional[Config] = None) -> Iterator[None]:
    """Construct modules on the meta device; `zerodp.initialize` materialises and shards them.

    Each module built here that holds meta tensors is guarded until then: run on real
    inputs before `zerodp.initialize`, it raises an error saying so, where torch would say
    "Tensor on device meta is not on the expected device cpu!"."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"zerodp.init takes a zerodp.Config, got {type(config).__name__}")
    built: dict[int, nn.Module] = {}

    def note(module: nn.Module, name: str, value) -> None:
        built[id(module)] = module
    # torch's own hooks on every registration of a parameter, buffer or submodule: the
    # modules built in this block, whatever classes they are.
    handles = [nn_module.register_module_parameter_registration_hook(note),
               nn_module.register_module_buffer_registration_hook(note),
               nn_module.register_module_module_registration_hook(note)]
    try:
        with torch.device("meta"):
            yield
    finally:
        for handle in handles:
            handle.remove()
    for m in built.values():
        if m not in _GUARDS and has_meta(m):
            _GUARDS[m] = (m.register_forward_pre_hook(_guard_forward, with_kwargs=True),
                          m.register_load_state_dict_pre_hook(_guard_load))


def _guard_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a module built under zerodp.init: refuses real inputs while its
    tensors are still on the meta device (no storage, no values). Meta inputs (shape
    tracing) pass; a module materialised some other way (`to_empty`) loses the guard."""
    if not has_meta(module):
        _release(module)
        return None
    tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
    if tensors and all(t.is_meta for t in tensors):
        return None
    raise RuntimeError(_used_too_early(module, "running it"))


def _guard_load(module: nn.Module, state_dict, prefix, local_metadata, *args) -> None:
    """load_state_dict pre-hook of the same modules: torch only warns that copying into a
    meta tensor does nothing, and zerodp.initialize would then draw fresh values, so the
    loaded weights would be lost. `assign=True` (which replaces the meta tensors) passes."""
    if local_metadata.get("assign_to_params_buffers", False) or not has_meta(module):
        return
    raise RuntimeError(_used_too_early(module, "loading weights into it") + "; to load weights, call "
                       "zerodp.load_pretrained or model.load_state_dict after zerodp.initialize")


def _used_too_early(module: nn.Module, what: str) -> str:
    meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    return (f"{type(module).__name__} was built under zerodp.init, so its parameters are on the meta device, "
            f"without storage or values ({len(meta)} of them, e.g. {meta[0]!r}), until zerodp.initialize(model, "
            f"...) gives them storage and initialises them: call zerodp.initialize before {what}, or build the "
            f"model outside zerodp.init to use it first")


def _release(module: nn.Module) -> None:
    for handle in _GUARDS.pop(module, ()):
        handle.remove()


def default_device() -> torch.device:
    """Where materialised parameters go: this rank's CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def materialize(model: nn.Module, device, on_param: Callable[[nn.Parameter, nn.Parameter], None]) -> None:
    """Give every meta parameter and buffer real storage on `device`, module by module in
    `model.modules()` order, initialised by the module's `reset_parameters()`.
    `on_param(old, new)` is called after each parameter's module was initialised."""
    registrations: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                registrations.setdefault(id(p), []).append((m, name))
    initialiser = _model_initialisers(model)
    for mname, m in model.named_modules():
        _release(m)  # real from now on: the guard of zerodp.init goes
        fresh = []
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.zeros_like(p, device=device), requires_grad=p.requires_grad)
                for owner, attr in registrations[id(p)]:  # keeps tied weights tied
                    owner._parameters[attr] = new
                fresh.append((p, new))
        meta_buffers = [n for n, b in m._buffers.items() if b is not None and b.is_meta]
        for name in meta_buffers:
            m._buffers[name] = torch.zeros_like(m._buffers[name], device=device)
        if fresh or meta_buffers:
            init_weights = initialiser.get(id(m))
            if not hasattr(m, "reset_parameters") and init_weights is None:
                what = [n for n, _ in m.named_parameters(recurse=False)] + meta_buffers
                raise ValueError(f"module {mname or '<root>'} ({type(m).__name__}) was built on the meta device with "
                                 f"{what} but has no reset_parameters() to initialise them: give it one, or "
                                 f"construct the model outside zerodp.init")
            with torch.no_grad():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
                if init_weights is not None:
                    init_weights(m)
        for old, new in fresh:
            on_param(old, new)


def _model_initialisers(model: nn.Module) -> dict:
    """id(module) -> the `_init_weights` of the innermost enclosing module that defines one
    (a Hugging Face PreTrainedModel: see the module docstring)."""
    out: dict = {}

    def visit(m: nn.Module, current) -> None:
        own = getattr(m, "_init_weights", None)
        current = own if _takes_a_module(own) else current
        if current is not None:
            out[id(m)] = current
        for child in m.children():
            visit(child, current)
    visit(model, None)
    return out


def _takes_a_module(fn) -> bool:
    """Whether `fn` can be called as fn(module) (HF's signature; a model's own
    `_init_weights(self)` of another kind is not an initialiser of modules)."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(nn.Module())
    except (TypeError, ValueError):
        return False
    return True


def check_same_initialisation(units: list, comm: Comm) -> None:
    """Born sharded, each rank keeps the shard of values it drew itself; with per-rank seeds
    (`torch.manual_seed(seed + rank)`, common in data-loading code) the shards would come
    from different models. Every rank compares the units' fingerprints with rank 0's."""
    mine = [u.init_fingerprint for u in units]
    everyone = comm.all_gather_object(mine)
    differ = sorted({(r, units[i].name) for r, theirs in enumerate(everyone) for i, (a, b) in enumerate(zip(theirs, everyone[0]))
                     if any(abs(x - y) > 1e-9 * (1.0 + abs(y)) for x, y in zip(a, b))})
    if differ:
        ranks = sorted({r for r, _ in differ})
        names = sorted({n for _, n in differ})
        raise RuntimeError(f"rank {comm.rank}: a model built under zerodp.init was initialised differently on ranks "
                           f"{ranks} than on rank 0 (units {names[:3]}): every rank must seed its generator the same "
                           f"(torch.manual_seed(seed), not seed + rank) before building the model; seed per rank "
                           f"only after zerodp.initialize")
