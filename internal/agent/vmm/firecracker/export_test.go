package firecracker

// RemoveInJail and ExistsInJail are the jail's file operations, for the attack tests.
var (
	RemoveInJail = removeInJail
	ExistsInJail = existsInJail
)

// CopyOut is the copy of a file out of a jail, for the attack tests.
var CopyOut = copyOut

// PlaceIn puts a host file in a jail, for the tests of copies across file systems.
var PlaceIn = placeIn
