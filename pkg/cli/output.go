// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"encoding"
	"encoding/json"
	"reflect"
)

var (
	jsonMarshaler = reflect.TypeFor[json.Marshaler]()
	textMarshaler = reflect.TypeFor[encoding.TextMarshaler]()
)

// emptyLists returns a copy of v with every nil slice and map made empty,
// so that encoding/json writes [] and {} for them. Values that encode
// themselves (json.Marshaler, encoding.TextMarshaler) are kept as they are.
func emptyLists(v reflect.Value) reflect.Value {
	if !v.IsValid() {
		return v
	}
	t := v.Type()
	if t.Implements(jsonMarshaler) || t.Implements(textMarshaler) ||
		reflect.PointerTo(t).Implements(jsonMarshaler) || reflect.PointerTo(t).Implements(textMarshaler) {
		return v
	}
	switch v.Kind() {
	case reflect.Pointer, reflect.Interface:
		if v.IsNil() {
			return v
		}
		if v.Kind() == reflect.Pointer {
			p := reflect.New(t.Elem())
			p.Elem().Set(emptyLists(v.Elem()))
			return p
		}
		out := reflect.New(t).Elem()
		out.Set(emptyLists(v.Elem()))
		return out
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 {
			return v // []byte is base64 text
		}
		out := reflect.MakeSlice(t, v.Len(), v.Len())
		for i := range v.Len() {
			out.Index(i).Set(emptyLists(v.Index(i)))
		}
		return out
	case reflect.Map:
		out := reflect.MakeMapWithSize(t, v.Len())
		for it := v.MapRange(); it.Next(); {
			out.SetMapIndex(it.Key(), emptyLists(it.Value()))
		}
		return out
	case reflect.Struct:
		out := reflect.New(t).Elem()
		out.Set(v)
		for i := range t.NumField() {
			if t.Field(i).IsExported() {
				out.Field(i).Set(emptyLists(v.Field(i)))
			}
		}
		return out
	}
	return v
}
