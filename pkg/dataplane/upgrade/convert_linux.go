// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package upgrade

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"
)

// A pinned map describes itself: the kernel keeps the BTF of its key and
// value, whichever build created it. A layout change is therefore read
// from the pin, never from a table of past layouts, and entries are
// converted field by field, matched by name: a field both layouts have is
// copied (an integer widened or narrowed), a field only the new one has
// starts zero, a field only the old one has is dropped. That covers a
// field added to or removed from a struct, a wider counter, a reordered
// struct, in both directions (upgrade and downgrade).

// mapTypes is the BTF of a map's key and value as the kernel holds them;
// nil when the map was created without BTF.
type mapTypes struct{ key, value btf.Type }

// pinnedTypes reads the key and value BTF of m from the kernel.
// cilium/ebpf's MapInfo has the BTF object's id but not the key's and
// value's type ids, so this asks BPF_OBJ_GET_INFO_BY_FD itself.
func pinnedTypes(m *ebpf.Map) (mapTypes, error) {
	// struct bpf_map_info up to btf_value_type_id (Linux 4.18).
	var info [80]byte
	attr := struct {
		fd, infoLen uint32
		info        uint64
	}{uint32(m.FD()), uint32(len(info)), uint64(uintptr(unsafe.Pointer(&info[0])))}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_OBJ_GET_INFO_BY_FD, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(m)
	runtime.KeepAlive(&info)
	if errno != 0 {
		return mapTypes{}, fmt.Errorf("map info: %w", errno)
	}
	le := binary.LittleEndian
	btfID, keyID, valueID := le.Uint32(info[64:]), le.Uint32(info[68:]), le.Uint32(info[72:])
	if btfID == 0 || valueID == 0 {
		return mapTypes{}, nil
	}
	h, err := btf.NewHandleFromID(btf.ID(btfID))
	if err != nil {
		return mapTypes{}, fmt.Errorf("map BTF: %w", err)
	}
	defer h.Close()
	spec, err := h.Spec(nil)
	if err != nil {
		return mapTypes{}, fmt.Errorf("map BTF: %w", err)
	}
	var out mapTypes
	if keyID != 0 {
		if out.key, err = spec.TypeByID(btf.TypeID(keyID)); err != nil {
			return mapTypes{}, fmt.Errorf("map key BTF: %w", err)
		}
	}
	if out.value, err = spec.TypeByID(btf.TypeID(valueID)); err != nil {
		return mapTypes{}, fmt.Errorf("map value BTF: %w", err)
	}
	return out, nil
}

// shape is a canonical description of a type's memory layout: member
// names, offsets, sizes and kinds, recursively; type names and typedefs
// do not count. Two types of one shape hold the same bytes the same way.
func shape(t btf.Type) string {
	var b strings.Builder
	writeShape(&b, t, 0)
	return b.String()
}

func writeShape(b *strings.Builder, t btf.Type, depth int) {
	if depth > 16 {
		b.WriteString("...")
		return
	}
	t = btf.UnderlyingType(t)
	size, _ := btf.Sizeof(t)
	switch t := t.(type) {
	case *btf.Struct, *btf.Union:
		var members []btf.Member
		if st, ok := t.(*btf.Struct); ok {
			members = st.Members
		} else {
			members = t.(*btf.Union).Members
		}
		fmt.Fprintf(b, "%T(%d){", t, size)
		for _, m := range members {
			fmt.Fprintf(b, "%s@%d", m.Name, m.Offset)
			if m.BitfieldSize != 0 {
				fmt.Fprintf(b, ":%d", m.BitfieldSize)
			}
			b.WriteByte('=')
			writeShape(b, m.Type, depth+1)
			b.WriteByte(';')
		}
		b.WriteByte('}')
	case *btf.Array:
		fmt.Fprintf(b, "[%d]", t.Nelems)
		writeShape(b, t.Type, depth+1)
	case *btf.Datasec:
		b.WriteString("datasec{")
		for _, v := range t.Vars {
			name := ""
			if vv, ok := v.Type.(*btf.Var); ok {
				name = vv.Name
			}
			fmt.Fprintf(b, "%s@%d/%d;", name, v.Offset, v.Size)
		}
		b.WriteByte('}')
	case *btf.Int:
		fmt.Fprintf(b, "int%d%s", t.Size, t.Encoding)
	default:
		fmt.Fprintf(b, "%T(%d)", t, size)
	}
}

// convertible reports whether values of from can be converted to to.
func convertible(to, from btf.Type) error {
	_, err := convert(to, from, nil)
	return err
}

// convert returns src, laid out as from, laid out as to (a nil src only
// checks that it can be done).
func convert(to, from btf.Type, src []byte) ([]byte, error) {
	size, err := btf.Sizeof(to)
	if err != nil {
		return nil, err
	}
	var dst []byte
	if src != nil {
		dst = make([]byte, size)
	}
	return dst, convertInto(dst, to, src, from, 0)
}

// convertInto fills dst (of type to) from src (of type from).
func convertInto(dst []byte, to btf.Type, src []byte, from btf.Type, depth int) error {
	if depth > 16 {
		return errors.New("types nested too deeply")
	}
	to, from = btf.UnderlyingType(to), btf.UnderlyingType(from)
	if shape(to) == shape(from) {
		copy(dst, src)
		return nil
	}
	switch to := to.(type) {
	case *btf.Struct:
		old, ok := from.(*btf.Struct)
		if !ok {
			return fmt.Errorf("%s became a struct", kindOf(from))
		}
		for _, m := range to.Members {
			if m.Name == "" {
				return fmt.Errorf("struct %s: an anonymous member changed", to.Name)
			}
			om, ok := member(old, m.Name)
			if !ok {
				continue // a new field starts zero
			}
			if m.BitfieldSize != 0 || om.BitfieldSize != 0 || m.Offset%8 != 0 || om.Offset%8 != 0 {
				return fmt.Errorf("struct %s: bit field %s changed", to.Name, m.Name)
			}
			n, err := btf.Sizeof(m.Type)
			if err != nil {
				return err
			}
			on, err := btf.Sizeof(om.Type)
			if err != nil {
				return err
			}
			var d, s []byte
			if src != nil {
				d, s = dst[m.Offset/8:][:n], src[om.Offset/8:][:on]
			}
			if err := convertInto(d, m.Type, s, om.Type, depth+1); err != nil {
				return fmt.Errorf("%s.%s: %w", to.Name, m.Name, err)
			}
		}
		return nil
	case *btf.Array:
		old, ok := from.(*btf.Array)
		if !ok {
			return fmt.Errorf("%s became an array", kindOf(from))
		}
		n, err := btf.Sizeof(to.Type)
		if err != nil {
			return err
		}
		on, err := btf.Sizeof(old.Type)
		if err != nil {
			return err
		}
		for i := 0; i < int(min(to.Nelems, old.Nelems)); i++ {
			var d, s []byte
			if src != nil {
				d, s = dst[i*n:][:n], src[i*on:][:on]
			}
			if err := convertInto(d, to.Type, s, old.Type, depth+1); err != nil {
				return fmt.Errorf("[%d]: %w", i, err)
			}
		}
		return nil
	case *btf.Int, *btf.Enum:
		switch from.(type) {
		case *btf.Int, *btf.Enum:
		default:
			return fmt.Errorf("%s became an integer", kindOf(from))
		}
		// Little endian: the low bytes come first, so copying the
		// common prefix widens (zero-extends) or narrows.
		copy(dst, src)
		return nil
	}
	return fmt.Errorf("%s changed to %s and cannot be converted", kindOf(from), kindOf(to))
}

func member(s *btf.Struct, name string) (btf.Member, bool) {
	for _, m := range s.Members {
		if m.Name == name {
			return m, true
		}
	}
	return btf.Member{}, false
}

func kindOf(t btf.Type) string {
	return strings.TrimPrefix(fmt.Sprintf("%T", t), "*btf.")
}
