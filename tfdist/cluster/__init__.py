"""Cluster tooling: TF_CONFIG, local multi-process clusters, Kubeflow TFJob manifests.

Example:

```python
from tfdist import cluster
code = cluster.launch(["python", "train.py"], workers=2, timeout=600)
```
"""

from tfdist.cluster.launch import launch
from tfdist.cluster.tf_config import TFConfig, free_ports, local_tf_configs, read_tf_config
from tfdist.cluster.tfjob import TFJobManifest, submit, tfjob

__all__ = ["TFConfig", "TFJobManifest", "free_ports", "launch", "local_tf_configs",
           "read_tf_config", "submit", "tfjob"]
