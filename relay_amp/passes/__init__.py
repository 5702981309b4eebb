"""Graph passes users chain: the layer index, recast, automatic mixed precision, cast cleanup, layouts and
range calibration. Each module holds a pass's functional form and its tvm.transform.Pass."""
