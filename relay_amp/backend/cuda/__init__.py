"""The CUDA backend: the tensor-core schedule rule and the pipeline that uses it ahead of TVM's dlight rules."""
