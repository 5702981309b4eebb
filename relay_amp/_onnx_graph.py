"""Reading an ONNX graph before import: its constant values, and the shapes ONNX's shape inference gives."""

import numpy as np


def constant_values(graph) -> dict[str, np.ndarray]:
    """The graph's initializers and Constant nodes' tensor values, by name."""
    from onnx import numpy_helper

    tensors = [(tensor.name, tensor) for tensor in graph.initializer]
    tensors += [(node.output[0], attribute.t) for node in graph.node if node.op_type == "Constant"
                for attribute in node.attribute if attribute.name == "value"]
    return {name: numpy_helper.to_array(tensor) for name, tensor in tensors}


def inferred_values(proto) -> dict[str, tuple[list[int | None], np.dtype]]:
    """The values whose shape ONNX's shape inference knows, by name: (dims, None where unknown; numpy dtype). None
    are known where the inference fails (a model over 2 GB, or one it rejects)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # the inference raises many error types
        return {}
    found = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            dims = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim]
            found[value.name] = (dims, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    return found
