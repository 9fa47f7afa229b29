"""EndpointPickerConfig documents shared by tests."""

# a queue scorer and a picker that answers the primary and two fallbacks
FALLBACKS = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
  parameters: {maxNumOfEndpoints: 3}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""

# one static endpoint (what Kubernetes discovery refuses to be combined with)
STATIC_ENDPOINT = (
    "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
    "plugins:\n- type: max-score-picker\n- type: queue-scorer\n"
    "schedulingProfiles: [{name: d, plugins: [{pluginRef: queue-scorer},\n"
    "  {pluginRef: max-score-picker}]}]\n"
    "endpoints: [{address: '10.0.0.1:8000'}]\n"
)
