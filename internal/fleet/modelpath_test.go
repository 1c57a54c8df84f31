package fleet

import "testing"

func TestUnderPrefixComparesSegments(t *testing.T) {
	for _, tc := range []struct {
		path, prefix string
		want         bool
	}{
		{"/ckpt/x", "/ckpt", true},
		{"/ckpt/x", "/ckpt/", true},
		{"/ckpt", "/ckpt/", true},
		{"/ckpt//x/./y", "/ckpt", true},
		{"/ckpt-evil/x", "/ckpt", false},
		{"/ckpt-evil/x", "/ckpt/", false},
		{"/ckptx", "/ckpt", false},
		{`/ckpt\x`, "/ckpt", false},
		{"ckpt/x", "/ckpt", false},
		{"/other/ckpt/x", "/ckpt", false},
		{"/anything", "/", true},
		{"s3://bucket/x", "s3://bucket/", true},
		{"s3://bucket", "s3://bucket/", true},
		{"s3://bucket-evil/x", "s3://bucket/", false},
		{"s3://bucket-evil/x", "s3://bucket", false},
		{"s3://bucket@evil/x", "s3://bucket/", false},
		{"S3://bucket/x", "s3://bucket/", false},
		{"gs://bucket/x", "s3://bucket/", false},
		{"s3://bucket/x", "/ckpt", false},
		{"/ckpt/x", "s3://bucket/", false},
		{"/ckpt/a://b", "/ckpt", true}, // a path with "://" in it, not a URL
		{"hf://org/model/sub", "hf://org/model", true},
		{"hf://org/model-2", "hf://org/model", false},
	} {
		if got := underPrefix(tc.path, tc.prefix); got != tc.want {
			t.Errorf("underPrefix(%q, %q) = %v; want %v", tc.path, tc.prefix, got, tc.want)
		}
	}
}
