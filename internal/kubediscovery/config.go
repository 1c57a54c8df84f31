// Package kubediscovery follows a Service's EndpointSlices through the
// Kubernetes API and tells its caller which endpoints they name. It holds
// all of the router's client-go code, so that a router without
// `workers_kubernetes` links it but never runs it, and the scheduler never
// sees Kubernetes.
package kubediscovery

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Config is one workers_kubernetes block: which EndpointSlices to follow
// and which of their ports and addresses make a worker.
type Config struct {
	// Namespace holds the slices; "" follows every namespace (which needs
	// a ClusterRole).
	Namespace string
	// Service names the Service whose slices to follow, through the label
	// kubernetes.io/service-name. Exactly one of Service and Selector.
	Service string
	// Selector is a label selector of the slices (a Service's slices carry
	// its labels). Exactly one of Service and Selector.
	Selector string
	// Port is a port number or a port name of the slices; "" takes a
	// slice's only TCP port.
	Port string
	// AddressType is "IPv4" (when "") or "IPv6": slices of the other
	// family are left out.
	AddressType string
	// Kubeconfig is the path of a kubeconfig file; "" uses the pod's
	// service account (in-cluster).
	Kubeconfig string
}

// Check validates c without contacting anything: every error names the
// field at fault. It reads the kubeconfig file, if any.
func (c Config) Check() error {
	if err := c.checkTarget(); err != nil {
		return err
	}
	if err := checkPort(c.Port); err != nil {
		return err
	}
	switch c.AddressType {
	case "", string(discoveryv1.AddressTypeIPv4), string(discoveryv1.AddressTypeIPv6):
	default:
		return fmt.Errorf("address_type %q: must be IPv4 or IPv6", c.AddressType)
	}
	if c.Kubeconfig != "" {
		if _, err := c.restConfig(); err != nil {
			return err
		}
	}
	return nil
}

// checkTarget checks the namespace and which slices to follow.
func (c Config) checkTarget() error {
	if c.Namespace != "" {
		if errs := validation.IsDNS1123Label(c.Namespace); len(errs) > 0 {
			return fmt.Errorf("namespace %q: %s", c.Namespace, strings.Join(errs, "; "))
		}
	}
	switch {
	case c.Service != "" && c.Selector != "":
		return errors.New("service and selector: give one, not both")
	case c.Service == "" && c.Selector == "":
		return errors.New("service or selector: give one")
	case c.Service != "":
		if errs := validation.IsDNS1035Label(c.Service); len(errs) > 0 {
			return fmt.Errorf("service %q: %s", c.Service, strings.Join(errs, "; "))
		}
	default:
		if _, err := labels.Parse(c.Selector); err != nil {
			return fmt.Errorf("selector %q: %v", c.Selector, err)
		}
	}
	return nil
}

// checkPort accepts "", a number from 1 to 65535, or a Kubernetes port
// name (IANA_SVC_NAME: up to 15 lower-case letters, digits and inner
// dashes, with a letter).
func checkPort(port string) error {
	if port == "" {
		return nil
	}
	if n, err := strconv.Atoi(port); err == nil {
		if n < 1 || n > 65535 {
			return fmt.Errorf("port %d: must be from 1 to 65535", n)
		}
		return nil
	}
	if errs := validation.IsValidPortName(port); len(errs) > 0 {
		return fmt.Errorf("port %q: neither a number nor a port name: %s", port, strings.Join(errs, "; "))
	}
	return nil
}

// selector is the label selector the API server filters the slices by.
func (c Config) selector() labels.Selector {
	if c.Service != "" {
		return labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: c.Service})
	}
	s, err := labels.Parse(c.Selector)
	if err != nil {
		// Check has refused it: select nothing rather than everything.
		return labels.Nothing()
	}
	return s
}

// addressType is the address family of the slices to follow.
func (c Config) addressType() discoveryv1.AddressType {
	if c.AddressType == "" {
		return discoveryv1.AddressTypeIPv4
	}
	return discoveryv1.AddressType(c.AddressType)
}

// restConfig reads the kubeconfig file, or the pod's service account when
// there is none; neither contacts the API server.
func (c Config) restConfig() (*rest.Config, error) {
	if c.Kubeconfig == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("in-cluster mode (no kubeconfig given): %w", err)
		}
		return cfg, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", c.Kubeconfig, err)
	}
	return cfg, nil
}
