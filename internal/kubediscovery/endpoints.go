package kubediscovery

import (
	"cmp"
	"fmt"
	"net"
	"slices"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// Endpoint is one worker the slices name: one per endpoint, at its first
// address (an endpoint's addresses are interchangeable), and one per
// address and port (see oneByAddress).
type Endpoint struct {
	// Key tells workers apart: the pod's targetRef.uid, so that a pod
	// replaced at the same address is a new worker; "address:port" for an
	// endpoint without a targetRef.
	Key string
	// Address is the endpoint's first address.
	Address string
	// Port is the slice's port that Config.Port names.
	Port int
	// Namespace and Pod name the pod behind the endpoint, from a targetRef
	// of kind Pod; "" otherwise.
	Namespace, Pod string
	// Ready, Serving and Terminating are the endpoint's conditions, with
	// the API's defaults: a missing ready means ready, a missing serving
	// means as ready, a missing terminating means not terminating.
	Ready, Serving, Terminating bool
}

// HostPort is the endpoint's address and port, as a dial takes them.
func (e Endpoint) HostPort() string {
	return net.JoinHostPort(e.Address, strconv.Itoa(e.Port))
}

// endpointsOf reads the endpoints of the slices that match, each endpoint
// once (the first slice by namespace and name that names it wins, as a
// slice's endpoints move between slices) and each address and port once
// (see oneByAddress), sorted by namespace, pod, address and key. It also
// says, by slice, why a matching slice gives no endpoint.
func endpointsOf(all []*discoveryv1.EndpointSlice, sel labels.Selector, c Config) ([]Endpoint, map[string]leftOut) {
	slices.SortFunc(all, func(a, b *discoveryv1.EndpointSlice) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	var out []Endpoint
	skipped := map[string]leftOut{}
	seen := map[string]bool{}
	for _, s := range all {
		if !sel.Matches(labels.Set(s.Labels)) || (c.Namespace != "" && s.Namespace != c.Namespace) {
			continue
		}
		port, left := usablePort(s, c)
		if left.why != "" {
			skipped[s.Namespace+"/"+s.Name] = left
			continue
		}
		for _, ep := range s.Endpoints {
			e, ok := endpointOf(ep, port)
			if ok && !seen[e.Key] {
				seen[e.Key] = true
				out = append(out, e)
			}
		}
	}
	out = oneByAddress(out)
	slices.SortFunc(out, func(a, b Endpoint) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Pod, b.Pod),
			cmp.Compare(a.Address, b.Address), cmp.Compare(a.Key, b.Key))
	})
	return out, skipped
}

// oneByAddress keeps one endpoint of those at each address and port: the
// most ready, as kube-proxy sends to an address while any endpoint there
// serves (ready, then serving, then neither; the first of equals). Two
// pods' endpoints name one address while the pod that replaces another at
// its address, or on its node's address (hostNetwork), is listed as the
// old one terminates: the old one's conditions are not the new one's, and
// the pair, each taken in turn, would make the worker a new process at
// every change.
func oneByAddress(eps []Endpoint) []Endpoint {
	out := make([]Endpoint, 0, len(eps))
	at := make(map[string]int, len(eps))
	for _, e := range eps {
		i, seen := at[e.HostPort()]
		switch {
		case !seen:
			at[e.HostPort()] = len(out)
			out = append(out, e)
		case readiness(e) > readiness(out[i]):
			out[i] = e
		}
	}
	return out
}

// readiness ranks an endpoint by how far it may take jobs.
func readiness(e Endpoint) int {
	switch {
	case e.Ready:
		return 2
	case e.Serving:
		return 1
	}
	return 0
}

// leftOut says why a matching slice gives no endpoint.
type leftOut struct {
	why string
	// misconfigured: the configured port does not fit the slice, or the
	// slice's port cannot be dialled (logged at warn), where another
	// address family (a dual-stack Service) is expected (info).
	misconfigured bool
}

// usablePort is the port of s that c names, or why s gives no endpoint.
// Only TCP ports count: the workers speak HTTP.
func usablePort(s *discoveryv1.EndpointSlice, c Config) (int, leftOut) {
	if s.AddressType != c.addressType() {
		return 0, leftOut{why: fmt.Sprintf("its address type is %s, not %s", s.AddressType, c.addressType())}
	}
	var tcp []discoveryv1.EndpointPort
	for _, p := range s.Ports {
		if p.Port != nil && (p.Protocol == nil || *p.Protocol == corev1.ProtocolTCP) {
			tcp = append(tcp, p)
		}
	}
	if c.Port == "" {
		if len(tcp) != 1 {
			return 0, leftOut{why: fmt.Sprintf("it has %d TCP ports and no port is configured", len(tcp)), misconfigured: true}
		}
		return inRange(int(*tcp[0].Port))
	}
	number, _ := strconv.Atoi(c.Port) // 0 for a name: a port name has a letter
	for _, p := range tcp {
		if int(*p.Port) == number || (number == 0 && p.Name != nil && *p.Name == c.Port) {
			return inRange(int(*p.Port))
		}
	}
	return 0, leftOut{why: fmt.Sprintf("none of its TCP ports is %s", c.Port), misconfigured: true}
}

// inRange is port, or why a slice whose port it is gives no endpoint: the
// API server stores no other, but nothing else may reach a dial.
func inRange(port int) (int, leftOut) {
	if port < 1 || port > 65535 {
		return 0, leftOut{why: fmt.Sprintf("its port %d is not from 1 to 65535", port), misconfigured: true}
	}
	return port, leftOut{}
}

// endpointOf is the worker of one endpoint at port, if it has an address.
func endpointOf(ep discoveryv1.Endpoint, port int) (Endpoint, bool) {
	if len(ep.Addresses) == 0 {
		return Endpoint{}, false
	}
	e := Endpoint{Address: ep.Addresses[0], Port: port}
	e.Key = e.HostPort()
	if ref := ep.TargetRef; ref != nil {
		if ref.UID != "" {
			e.Key = string(ref.UID)
		}
		if ref.Kind == "Pod" {
			e.Namespace, e.Pod = ref.Namespace, ref.Name
		}
	}
	cond := ep.Conditions
	e.Ready = cond.Ready == nil || *cond.Ready
	e.Serving = e.Ready
	if cond.Serving != nil {
		e.Serving = *cond.Serving
	}
	e.Terminating = cond.Terminating != nil && *cond.Terminating
	return e, true
}
