package kubediscovery

import (
	"context"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
)

// API is what this package asks the Kubernetes API server: EndpointSlices
// listed and watched in a namespace ("": every namespace).
type API interface {
	// ListSlices lists the slices opts select.
	ListSlices(ctx context.Context, namespace string, opts metav1.ListOptions) (*discoveryv1.EndpointSliceList, error)
	// WatchSlices watches the slices opts select.
	WatchSlices(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error)
}

// userAgent names the router in the API server's logs and audit.
const userAgent = "miles-diffusion-router"

// restAPI is API over a REST client that knows discovery.k8s.io/v1 alone:
// client-go's clientset (k8s.io/client-go/kubernetes) registers every
// API group's types and clients, which would add some 50 MB to Caddy's
// binary where this adds 12.
type restAPI struct {
	client *rest.RESTClient
	params runtime.ParameterCodec
}

// Client makes the API client c names, from its kubeconfig or, without
// one, from the pod's service account; outside a cluster the latter fails,
// naming in-cluster mode. It contacts nothing.
func Client(c Config) (API, error) {
	cfg, err := c.restConfig()
	if err != nil {
		return nil, err
	}
	scheme := runtime.NewScheme()
	if err := discoveryv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	cfg.UserAgent = userAgent
	cfg.GroupVersion = &discoveryv1.SchemeGroupVersion
	cfg.APIPath = "/apis"
	cfg.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	client, err := rest.RESTClientFor(cfg)
	if err != nil {
		return nil, err
	}
	return restAPI{client: client, params: runtime.NewParameterCodec(scheme)}, nil
}

// ListSlices lists the slices opts select.
func (a restAPI) ListSlices(ctx context.Context, namespace string, opts metav1.ListOptions) (*discoveryv1.EndpointSliceList, error) {
	list := &discoveryv1.EndpointSliceList{}
	err := a.request(namespace, opts).Do(ctx).Into(list)
	return list, err
}

// WatchSlices watches the slices opts select.
func (a restAPI) WatchSlices(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return a.request(namespace, opts).Watch(ctx)
}

func (a restAPI) request(namespace string, opts metav1.ListOptions) *rest.Request {
	return a.client.Get().Namespace(namespace).Resource("endpointslices").VersionedParams(&opts, a.params)
}
