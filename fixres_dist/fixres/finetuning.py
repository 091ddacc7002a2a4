"""The FixRes method (Touvron et al., "Fixing the train-test resolution discrepancy", NeurIPS 2019).

A classifier trained with RandomResizedCrop at K_train sees objects larger than at test time; at a
higher test resolution K_test the apparent sizes match better, but the pooled activations change
statistics. FixRes (section 4) therefore finetunes, at K_test and with the *test* preprocessing,
only the classifier and the normalisation just before pooling. The reference code named those
layers per architecture (``layer4[2].bn3`` for ResNet-50); here they are found by *data flow*
(:func:`find_finetune_layers`), from the autograd graph of one forward pass, for any architecture:

* the **classifier** is the ``nn.Linear`` whose output is nearest the logits (fewest autograd
  operations between them); its input is the embedding (:mod:`fixres_dist.training.extraction`);
* the **main path** is the longest chain of operations from the input to the classifier's output,
  counted in autograd nodes. A residual branch (convolutions, norms, activations) is longer than
  the shortcut it runs beside (identity, or one 1x1 convolution and its norm), so the main path goes
  through every residual branch and through no projection shortcut;
* the **last norm** is the last normalisation layer (BatchNorm, LayerNorm, GroupNorm and their
  subclasses, :data:`NORM_TYPES`) on the main path: the one that feeds the head. Execution order is
  not data flow: in a ResNet whose last block has a projection shortcut the shortcut's BatchNorm
  (``layer4.0.downsample.1``) runs last, but the main-path norm is the residual branch's
  (``layer4.0.bn2``). Parallel branches of equal length (Inception) are broken by execution order:
  the later one wins. ``--last-norm NAME`` overrides the choice; it must name a normalisation module
  on the main path (:func:`find_finetune_layers` says why not otherwise);
* the **head**, for a multi-layer classifier, is *every module with parameters of its own whose
  output lies on a path from the last norm's output to the logits*: all that runs after the last
  norm and is not frozen-by-construction. So mobilenet_v3's head is ``classifier.0`` (Linear
  960->1280) and ``classifier.3``, not ``classifier.3`` alone with a frozen layer between the norm
  and it; a ResNet's is ``fc``, a ViT's ``heads.head`` (after ``encoder.ln``), a ConvNeXt's
  ``classifier.2`` (its norm is ``classifier.0``, a LayerNorm2d). Parameter-free modules (pooling,
  activations, dropout) have nothing to train. A model without any normalisation layer on the main
  path has as head the classifier and every module with parameters after it (usually the classifier
  alone). With ``--last-norm`` naming an earlier main-path norm, everything with parameters after
  that norm is head (e.g. a ResNet's last ``conv2``, ``bn2`` and ``fc`` for ``layer4.1.bn1``).

Modules are recognised by the autograd node of their output, recorded by forward hooks; the input
has ``requires_grad`` so every operation that depends on it is a node. This needs no symbolic
tracing (torch.fx), so data-dependent forwards, dynamic padding (EfficientNet-Lite) and in-place
operations (``ReLU(inplace=True)``, ``out += identity``: the hook records the node at the time the
module returns, before the in-place operation rebases the tensor) are all handled. A module's
parameters the model itself holds directly (the root model: ViT's ``class_token``) never count as
head.

What trains is ``--finetune-scope`` (:data:`SCOPES`). The frozen part stays in eval mode during
training (:func:`set_train_mode`), so only trainable norms' running statistics move, and
trainable BatchNorms are synchronised over the ranks (:mod:`fixres_dist.models.batchnorm`), so their
statistics are those of the union of all ranks' images.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import math

import torch
from torch import nn

from fixres_dist.config import SCOPES
from fixres_dist.errors import FixresError

NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)
# torchvision RandomResizedCrop's default area range, the fraction of the image a training crop covers.
RRC_SCALE = (0.08, 1.0)


@dataclasses.dataclass(frozen=True)
class FinetuneLayers:
    """What a FixRes finetune trains in a model, as found by :func:`find_finetune_layers`.

    ``classifier``: name of the ``nn.Linear`` whose output is nearest the logits. ``head``: names
    of the modules with parameters from the last norm's output to the logits, in execution order;
    always includes ``classifier``. ``last_norm``: name of the last normalisation layer on the main
    path, or None when the main path has none.
    """

    classifier: str
    head: tuple[str, ...]
    last_norm: str | None


@dataclasses.dataclass
class _Trace:
    """One forward pass: the autograd graph, and which module produced which node."""

    logits: object                      # autograd node of the model's output
    input: object                       # autograd node of the input
    owner: dict                         # node -> name of the innermost module that returned it
    outputs: dict                       # module name -> its output nodes (one per call)
    order: dict                         # module name -> index of its first return in the forward pass


def _tensors(value):
    """The tensors in a module's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _trace(model: nn.Module, input_size: int) -> _Trace:
    """Run ``model`` (eval mode, gradients on) on a (1, 3, input_size, input_size) zero image, recording
    every module's output node. Raises FixresError when the output does not depend on the input."""
    owner, outputs, order = {}, collections.defaultdict(list), {}

    def record(module, args, out, name):
        order.setdefault(name, len(order))
        for tensor in _tensors(out):
            if tensor.grad_fn is not None:
                owner.setdefault(tensor.grad_fn, name)  # innermost first: hooks run as modules return
                outputs[name].append(tensor.grad_fn)

    first = next(model.parameters(), None)
    if first is None:
        raise FixresError(f"{type(model).__name__} has no parameters to finetune")
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: record(mod, args, out, name))
             for name, m in model.named_modules()]
    try:
        with eval_mode(model), torch.enable_grad():
            leaf = torch.zeros(1, 3, input_size, input_size, device=first.device, dtype=first.dtype,
                               requires_grad=True)
            image = leaf.clone()  # not a leaf: a model may modify its input in place
            out = model(image)
    finally:
        for h in hooks:
            h.remove()
    logits = next((t for t in _tensors(out) if t.grad_fn is not None), None)
    if logits is None:
        raise FixresError(f"{type(model).__name__}'s output does not depend on its input; cannot find its head")
    return _Trace(logits.grad_fn, image.grad_fn, owner, dict(outputs), order)


def _post_order(root) -> tuple[list, dict]:
    """Nodes reachable backward from ``root`` (children before parents) and each node's children."""
    children, post, stack = {}, [], [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            post.append(node)
            continue
        if node in children:
            continue
        kids = [n for n, _ in node.next_functions if n is not None]
        children[node] = kids
        stack.append((node, True))
        stack.extend((k, False) for k in kids if k not in children)
    return post, children


def _longest_from_input(post: list, children: dict, source) -> dict:
    """node -> number of operations on the longest path from ``source`` (nodes not depending on it absent)."""
    dist = {}
    for node in post:
        if node is source:
            dist[node] = 0
        else:
            reached = [dist[k] for k in children[node] if k in dist]
            if reached:
                dist[node] = 1 + max(reached)
    return dist


def _longest_to_root(post: list, children: dict) -> dict:
    """node -> number of operations on the longest path from it to the root (``post[-1]``)."""
    dist = {post[-1]: 0}
    for node in reversed(post):  # parents before children
        for k in children[node]:
            dist[k] = max(dist.get(k, -1), dist[node] + 1)
    return dist


def _shortest_to_root(root, children: dict) -> dict:
    """node -> fewest operations between it and ``root`` (breadth-first)."""
    dist, queue = {root: 0}, collections.deque([root])
    while queue:
        node = queue.popleft()
        for k in children[node]:
            if k not in dist:
                dist[k] = dist[node] + 1
                queue.append(k)
    return dist


def find_finetune_layers(model: nn.Module, input_size: int, last_norm: str | None = None) -> FinetuneLayers:
    """Classifier, head and last norm of ``model``, found by data flow (see the module docstring).

    Runs one forward pass with gradients on a zero image of shape (1, 3, input_size, input_size)
    (pixels) in eval mode; every module's mode is restored afterwards and no gradient is computed.
    ``last_norm`` (``--last-norm``) replaces the automatic choice of the last norm; the head is then
    what runs after that norm. Raises a one-line :class:`FixresError` when the model has no
    ``nn.Linear`` on the way to its output, when ``last_norm`` names no normalisation module (the
    message lists the closest names), or when it names one off the main path (on a shortcut, in a
    shorter parallel branch, after the classifier or never run; the message names the main-path
    norm).
    """
    trace = _trace(model, input_size)
    modules = dict(model.named_modules())
    post, children = _post_order(trace.logits)
    near = _shortest_to_root(trace.logits, children)
    linears = [n for n in near if isinstance(modules.get(trace.owner.get(n)), nn.Linear)]
    if not linears:
        raise FixresError(f"{type(model).__name__} has no nn.Linear classifier head to finetune")
    top = min(near[n] for n in linears)
    classifier_node = max((n for n in linears if near[n] == top), key=lambda n: trace.order[trace.owner[n]])
    classifier = trace.owner[classifier_node]

    # The main path: nodes on a longest input -> classifier chain.
    sub_post, sub_children = _post_order(classifier_node)
    from_input = _longest_from_input(sub_post, sub_children, trace.input)
    to_classifier = _longest_to_root(sub_post, sub_children)
    length = from_input.get(classifier_node)

    def on_main_path(node) -> bool:
        return length is not None and node in from_input and from_input[node] + to_classifier[node] == length

    main_norms = [(node, name) for name, nodes in trace.outputs.items() if isinstance(modules[name], NORM_TYPES)
                  for node in nodes if trace.owner.get(node) == name and on_main_path(node)]
    auto = max(main_norms, key=lambda item: (from_input[item[0]], trace.order[item[1]]), default=None)
    chosen = auto
    if last_norm is not None:
        _checked_last_norm(model, modules, last_norm, main_norms, auto, classifier)
        chosen = max((item for item in main_norms if item[1] == last_norm), key=lambda item: from_input[item[0]])

    # The head: modules with parameters of their own whose output depends on the norm's output.
    start = chosen[0] if chosen else classifier_node
    depends = {}
    for node in post:
        depends[node] = node is start or any(depends[k] for k in children[node])
    head = {classifier}
    for node in post:
        name = trace.owner.get(node)
        if depends[node] and node is not start and name and \
                any(True for _ in modules[name].parameters(recurse=False)):
            head.add(name)
    return FinetuneLayers(classifier, tuple(sorted(head, key=trace.order.__getitem__)),
                          chosen[1] if chosen else None)


def _checked_last_norm(model, modules, name, main_norms, auto, classifier) -> None:
    """One-line FixresError unless ``--last-norm name`` is a normalisation module on the main path."""
    model_name = type(model).__name__
    norms = [n for n, m in modules.items() if isinstance(m, NORM_TYPES)]
    if not isinstance(modules.get(name), NORM_TYPES):
        what = f"is a {type(modules[name]).__name__}, not a normalisation layer" if name in modules else \
            "names no module"
        close = difflib.get_close_matches(name, norms, n=3, cutoff=0.0)
        hint = f"; closest normalisation layers: {', '.join(close)}" if close else \
            f"; {model_name} has no normalisation layer"
        if auto:
            hint += f" (the automatic choice is {auto[1]})"
        raise FixresError(f"--last-norm {name!r} {what} of {model_name}{hint}")
    found = [item for item in main_norms if item[1] == name]
    if not found:
        main = f"the main-path last norm is {auto[1]}" if auto else f"{model_name} has no norm on its main path"
        raise FixresError(f"--last-norm {name} is off the main path of {model_name} (a shortcut, a shorter "
                          f"parallel branch, or not between the input and the classifier {classifier}); {main}")


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """``model.eval()`` inside the block; afterwards every module gets back its *own* mode.

    ``model.train(was_training)`` would instead put the frozen part of a finetune (eval mode, see
    :func:`set_train_mode`) back in training mode.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def find_head_and_last_norm(model: nn.Module, input_size: int) -> tuple[str, str | None]:
    """``(classifier name, last norm name or None)`` of :func:`find_finetune_layers`.

    The classifier is the final ``nn.Linear`` (its input is the embedding, its weight is
    (num_classes, D)); the whole head may hold more modules (see :class:`FinetuneLayers`). Raises
    :class:`FixresError` without an ``nn.Linear`` head.
    """
    layers = find_finetune_layers(model, input_size)
    return layers.classifier, layers.last_norm


def trainable_modules(model: nn.Module, input_size: int, scope: str = "head+last-norm",
                      last_norm: str | None = None) -> list[str]:
    """Names of the modules whose parameters train under ``scope`` (one of :data:`SCOPES`).

    ``"head"``: the head of :func:`find_finetune_layers` (the classifier and every module with
    parameters between the last norm and the logits); ``"head+last-norm"``: that and the last norm;
    ``"norms+head"``: every normalisation layer with parameters and the head; ``"all"`` returns
    ``[""]`` (the whole model). ``last_norm`` (``--last-norm``) overrides the last norm, and is
    checked under every scope. ``input_size`` is the probe's side in pixels. Raises
    :class:`FixresError` when the model lacks what the scope names (no head; no norm before the head
    for ``head+last-norm``; no norm layer with parameters for ``norms+head``) or for a bad
    ``last_norm``.
    """
    if scope not in SCOPES:
        raise FixresError(f"--finetune-scope must be one of {', '.join(SCOPES)}; got {scope!r}")
    layers = find_finetune_layers(model, input_size, last_norm)
    if scope == "all":
        return [""]
    if scope == "head":
        return list(layers.head)
    if scope == "head+last-norm":
        if layers.last_norm is None:
            raise FixresError(f"--finetune-scope head+last-norm: {type(model).__name__} has no normalisation "
                              f"layer before its head {layers.classifier}; use --finetune-scope head")
        return [*layers.head, layers.last_norm]
    norms = [name for name, m in model.named_modules()
             if isinstance(m, NORM_TYPES) and any(True for _ in m.parameters(recurse=False))]
    if not norms:
        raise FixresError(f"--finetune-scope norms+head: {type(model).__name__} has no normalisation layer "
                          "with parameters; use --finetune-scope head")
    return [*norms, *(name for name in layers.head if name not in norms)]


def freeze_for_finetune(model: nn.Module, input_size: int, scope: str = "head+last-norm",
                        last_norm: str | None = None) -> list[str]:
    """Set ``requires_grad`` so that only the modules of ``scope`` train (see :func:`trainable_modules`).

    Call before wrapping in DDP. Returns the names of the parameters left trainable.
    """
    keep = tuple(f"{name}." if name else "" for name in trainable_modules(model, input_size, scope, last_norm))
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(keep))
        if param.requires_grad:
            trainable.append(name)
    return trainable



def set_train_mode(model: nn.Module) -> None:
    """Training mode for what trains, eval mode for the frozen rest.

    With every parameter trainable this is ``model.train()``. Otherwise the model is put in eval
    mode and only modules holding a trainable parameter of their own go back to train mode, so
    frozen BatchNorms keep their running statistics (FixRes trained only the last BN's) and the
    frozen backbone's dropout and stochastic depth stay off: the trainable norm then sees the same
    activations as at test time, and its statistics are estimated under test-time behaviour.
    """
    if all(p.requires_grad for p in model.parameters()):
        model.train()
        return
    model.eval()
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.train()


def apparent_size_test_resolution(train_size: int, scale: tuple[float, float] = RRC_SCALE,
                                  crop_ratio: float = 0.875) -> float:
    """The test resolution (pixels) at which objects look, on average, as large as in training.

    FixRes section 3.1 ("apparent object size"): a RandomResizedCrop covering a fraction ``s`` of the
    image area is resized to ``train_size``, so an object spanning a fraction ``r`` of the image side
    appears ``r * train_size / sqrt(s)`` pixels wide; at test time the shorter side is resized to
    ``K_test / crop_ratio`` and the object appears ``r * K_test / crop_ratio`` pixels wide. With ``s``
    uniform on ``[a, b]`` (torchvision's sampling; aspect-ratio jitter ignored),
    ``E[s^-1/2] = 2 (sqrt(b) - sqrt(a)) / (b - a)``, and equal mean apparent sizes give
    ``K_test = crop_ratio * train_size * E[s^-1/2]``: 1.364 x train_size for the default scale
    (0.08, 1). (With aspect-ratio jitter torchvision redraws crops
    that do not fit the image, which favours small crops: sampled, the factor is about 5 % larger.)
    Example: 306 px for 224 px training (the paper found ResNet-50 trained at 224 px best near
    288 px without finetuning). Our derivation under the section's model: an analytic first guess,
    not a measurement; sweep to choose (``--test-sizes``).
    """
    a, b = scale
    if not 0 < a <= b:
        raise FixresError(f"RandomResizedCrop scale must satisfy 0 < min <= max, got {scale}")
    mean_inverse_side = 1 / math.sqrt(a) if a == b else 2 * (math.sqrt(b) - math.sqrt(a)) / (b - a)
    return crop_ratio * train_size * mean_inverse_side


def finetune_resolution_warning(train_size: int | None, finetune_size: int) -> str | None:
    """A warning when the finetune resolution is below the train resolution (pixels), else None.

    Allowed, but FixRes (section 3) predicts the opposite: RandomResizedCrop makes objects look
    larger in training than under the test preprocessing, so the best test resolution is *above*
    the train resolution (:func:`apparent_size_test_resolution`).
    """
    if not train_size or finetune_size >= train_size:
        return None
    return (f"finetuning at {finetune_size} px, below the train resolution {train_size} px: FixRes predicts the "
            f"opposite (objects look larger in training; about "
            f"{apparent_size_test_resolution(train_size):.0f} px matches their apparent size)")
